//! Weight matrices in host memory. A matrix whose values are all exactly
//! representable in bf16 (every BF16, FP8 and FP4 checkpoint dequantises to such
//! values) is kept as bf16: same numbers, half the bytes to stream per decode step.

use crate::backend::HostMatrix;
use crate::quant::f32_to_bf16;
use crate::stored::{Stored, WeightView};

#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// `[rows, cols]` row-major (torch `Linear` layout).
#[derive(Clone, Debug, PartialEq)]
pub struct CpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

/// A borrowed run of weight rows.
#[derive(Clone, Copy, Debug)]
pub(crate) enum WRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> WRef<'a> {
    /// Rows `lo..hi` of a matrix with `k` columns.
    pub(crate) fn rows(self, k: usize, lo: usize, hi: usize) -> WRef<'a> {
        match self {
            WRef::F32(d) => WRef::F32(&d[lo * k..hi * k]),
            WRef::Bf16(d) => WRef::Bf16(&d[lo * k..hi * k]),
        }
    }

    pub(crate) fn len(self) -> usize {
        match self {
            WRef::F32(d) => d.len(),
            WRef::Bf16(d) => d.len(),
        }
    }

    /// `x · w[o, :]`.
    #[inline]
    pub(crate) fn row_dot(self, k: usize, o: usize, x: &[f32]) -> f32 {
        match self {
            WRef::F32(d) => super::simd::dot(x, &d[o * k..(o + 1) * k]),
            WRef::Bf16(d) => super::simd::dot_bf16(x, &d[o * k..(o + 1) * k]),
        }
    }
}

impl CpuMatrix {
    pub fn from_host(m: HostMatrix) -> Self {
        let exact_bf16 = m.data.iter().all(|&v| f32::from_bits((f32_to_bf16(v) as u32) << 16).to_bits() == v.to_bits());
        let data = if exact_bf16 {
            WeightData::Bf16(m.data.iter().map(|&v| f32_to_bf16(v)).collect())
        } else {
            WeightData::F32(m.data)
        };
        CpuMatrix { rows: m.rows, cols: m.cols, data }
    }

    /// A stored weight, dequantised: BF16 is kept as it is, FP8 and FP4 become bf16
    /// (their values are exact in bf16), F32/F16 go through [`CpuMatrix::from_host`].
    pub fn from_view(w: &WeightView<'_>) -> Self {
        let data = match &w.data {
            Stored::Bf16(b) => WeightData::Bf16(b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
            Stored::Fp8 { .. } | Stored::Fp4 { .. } => {
                WeightData::Bf16(w.dequantize().iter().map(|&v| f32_to_bf16(v)).collect())
            }
            Stored::F32(_) | Stored::F16(_) => return Self::from_host(HostMatrix::new(w.rows, w.cols, w.dequantize())),
        };
        CpuMatrix { rows: w.rows, cols: w.cols, data }
    }

    pub(crate) fn as_ref(&self) -> WRef<'_> {
        match &self.data {
            WeightData::F32(d) => WRef::F32(d),
            WeightData::Bf16(d) => WRef::Bf16(d),
        }
    }

    /// Row `r` as f32.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = self.cols;
        match &self.data {
            WeightData::F32(d) => out.copy_from_slice(&d[r * k..(r + 1) * k]),
            WeightData::Bf16(d) => super::simd::widen_bf16(&d[r * k..(r + 1) * k], out),
        }
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self.data, WeightData::Bf16(_))
    }
}
