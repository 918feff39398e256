//! Weight matrices as a checkpoint stores them: a typed, borrowed view of the stored
//! bytes (dtype, shape, block-scale layout), which is what a backend is handed at load.
//! A GPU backend keeps FP8 and FP4 weights in those formats and dequantises inside its
//! kernels; the CPU backend (the reference) dequantises here.
//!
//! Formats (DeepSeek V4 ships the last two):
//! - F32, BF16, F16: dense little-endian values, `[rows, cols]` row-major;
//! - FP8 e4m3fn codes `[rows, cols]` with one scale per [`FP8_BLOCK`] block (grid
//!   `ceil(rows/128) × ceil(cols/128)`);
//! - FP4 e2m1 packed two per byte, low nibble = even column, `[rows, cols/2]` bytes,
//!   with one scale per [`FP4_GROUP`] consecutive columns of a row (grid
//!   `rows × ceil(cols/32)`).
//!
//! Scales are ue8m0 bytes (`2^(b-127)`) as DeepSeek ships them, or floats in older
//! checkpoints (kept as f32).

use rayon::prelude::*;

use crate::backend::HostMatrix;
use crate::quant::{self, QuantError};

/// FP8 block shape (`weight_block_size`).
pub const FP8_BLOCK: (usize, usize) = (128, 128);
/// Inputs per FP4 scale.
pub const FP4_GROUP: usize = 32;

/// Block scales of a quantised weight, row-major over their grid.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales<'a> {
    /// Power-of-two scales as ue8m0 exponent bytes.
    Ue8m0(&'a [u8]),
    /// Scales stored in a float container, widened.
    F32(Vec<f32>),
}

impl Scales<'_> {
    pub fn len(&self) -> usize {
        match self {
            Scales::Ue8m0(b) => b.len(),
            Scales::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> f32 {
        match self {
            Scales::Ue8m0(b) => quant::ue8m0_to_f32(b[i]),
            Scales::F32(v) => v[i],
        }
    }

    /// All scales as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }

    /// The scales as ue8m0 bytes, when every one is a power of two in ue8m0's range.
    pub fn to_ue8m0(&self) -> Option<Vec<u8>> {
        match self {
            Scales::Ue8m0(b) => Some(b.to_vec()),
            Scales::F32(v) => v
                .iter()
                .map(|&s| {
                    let bits = s.to_bits();
                    let (exp, man) = ((bits >> 23) & 0xff, bits & 0x7f_ffff);
                    (s > 0.0 && man == 0 && (1..=254).contains(&exp)).then_some(exp as u8)
                })
                .collect(),
        }
    }

    /// Bytes the scales take as stored.
    pub fn stored_bytes(&self) -> usize {
        match self {
            Scales::Ue8m0(b) => b.len(),
            Scales::F32(v) => 4 * v.len(),
        }
    }
}

/// The stored values of a weight matrix.
#[derive(Clone, Debug, PartialEq)]
pub enum Stored<'a> {
    F32(&'a [u8]),
    Bf16(&'a [u8]),
    F16(&'a [u8]),
    Fp8 { codes: &'a [u8], scales: Scales<'a> },
    Fp4 { packed: &'a [u8], scales: Scales<'a> },
}

/// A `[rows, cols]` weight (torch `Linear` layout: rows are output features) as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: Stored<'a>,
}

impl<'a> From<&'a HostMatrix> for WeightView<'a> {
    /// An f32 matrix computed on the host (tests, tools).
    fn from(m: &'a HostMatrix) -> Self {
        WeightView { rows: m.rows, cols: m.cols, data: Stored::F32(bytemuck::cast_slice(&m.data)) }
    }
}

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[2 * i], b[2 * i + 1]])
}

impl<'a> WeightView<'a> {
    /// "f32", "bf16", "f16", "fp8" or "fp4".
    pub fn format(&self) -> &'static str {
        match self.data {
            Stored::F32(_) => "f32",
            Stored::Bf16(_) => "bf16",
            Stored::F16(_) => "f16",
            Stored::Fp8 { .. } => "fp8",
            Stored::Fp4 { .. } => "fp4",
        }
    }

    /// Scale grid `(rows, cols)` the format needs, if it is block-scaled.
    pub fn scale_grid(&self) -> Option<(usize, usize)> {
        match self.data {
            Stored::Fp8 { .. } => Some((self.rows.div_ceil(FP8_BLOCK.0), self.cols.div_ceil(FP8_BLOCK.1))),
            Stored::Fp4 { .. } => Some((self.rows, self.cols.div_ceil(FP4_GROUP))),
            _ => None,
        }
    }

    /// Bytes as stored, scales included.
    pub fn stored_bytes(&self) -> usize {
        match &self.data {
            Stored::F32(b) | Stored::Bf16(b) | Stored::F16(b) => b.len(),
            Stored::Fp8 { codes, scales } => codes.len() + scales.stored_bytes(),
            Stored::Fp4 { packed, scales } => packed.len() + scales.stored_bytes(),
        }
    }

    /// Check that the byte and scale counts match the shape.
    pub fn validate(&self) -> Result<(), QuantError> {
        let (rows, cols) = (self.rows, self.cols);
        let n = rows * cols;
        let grid_ok = |s: &Scales<'_>, block: (usize, usize)| {
            let want = self.scale_grid().expect("block-scaled");
            if s.len() == want.0 * want.1 {
                Ok(())
            } else {
                Err(QuantError::ScaleGrid { rows, cols, block, want, got: (s.len(), 1) })
            }
        };
        match &self.data {
            Stored::F32(b) if b.len() == 4 * n => Ok(()),
            Stored::Bf16(b) | Stored::F16(b) if b.len() == 2 * n => Ok(()),
            Stored::F32(b) => Err(QuantError::DenseLen { dtype: "F32", want: 4 * n, got: b.len() }),
            Stored::Bf16(b) | Stored::F16(b) => {
                Err(QuantError::DenseLen { dtype: self.format(), want: 2 * n, got: b.len() })
            }
            Stored::Fp8 { codes, scales } => {
                if codes.len() != n {
                    return Err(QuantError::Fp8Len { want: n, got: codes.len() });
                }
                grid_ok(scales, FP8_BLOCK)
            }
            Stored::Fp4 { packed, scales } => {
                if !cols.is_multiple_of(2) || packed.len() * 2 != n {
                    return Err(QuantError::Fp4Len { rows, cols, want: n / 2, got: packed.len() });
                }
                grid_ok(scales, (1, FP4_GROUP))
            }
        }
    }

    /// Row `r` as f32 values into `out` (`cols` long).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = self.cols;
        let base = r * k;
        match &self.data {
            Stored::F32(b) => out.iter_mut().enumerate().for_each(|(c, o)| *o = f32_at(b, base + c)),
            Stored::Bf16(b) => {
                out.iter_mut().enumerate().for_each(|(c, o)| *o = quant::bf16_to_f32(u16_at(b, base + c)))
            }
            Stored::F16(b) => out.iter_mut().enumerate().for_each(|(c, o)| *o = quant::f16_to_f32(u16_at(b, base + c))),
            Stored::Fp8 { codes, scales } => {
                let gc = k.div_ceil(FP8_BLOCK.1);
                let srow = (r / FP8_BLOCK.0) * gc;
                for (c, o) in out.iter_mut().enumerate() {
                    *o = quant::fp8_e4m3_to_f32(codes[base + c]) * scales.get(srow + c / FP8_BLOCK.1);
                }
            }
            Stored::Fp4 { packed, scales } => {
                let gc = k.div_ceil(FP4_GROUP);
                for (c, o) in out.iter_mut().enumerate() {
                    let byte = packed[(base + c) / 2];
                    let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    *o = quant::FP4_E2M1[nib as usize] * scales.get(r * gc + c / FP4_GROUP);
                }
            }
        }
    }

    /// The whole matrix as f32 (the CPU reference's path; validate first).
    pub fn dequantize(&self) -> Vec<f32> {
        let k = self.cols;
        let mut out = vec![0f32; self.rows * k];
        if k > 0 {
            out.par_chunks_mut(k).enumerate().for_each(|(r, row)| self.row_into(r, row));
        }
        out
    }

    /// Whether every value is exactly a bf16 value (FP8 and FP4 always are).
    pub fn exact_in_bf16(&self) -> bool {
        match &self.data {
            Stored::F32(b) => (0..self.rows * self.cols).into_par_iter().all(|i| {
                let v = f32_at(b, i);
                quant::bf16_to_f32(quant::f32_to_bf16(v)).to_bits() == v.to_bits()
            }),
            Stored::F16(b) => (0..self.rows * self.cols).into_par_iter().all(|i| {
                let v = quant::f16_to_f32(u16_at(b, i));
                quant::bf16_to_f32(quant::f32_to_bf16(v)).to_bits() == v.to_bits()
            }),
            Stored::Bf16(_) | Stored::Fp8 { .. } | Stored::Fp4 { .. } => true,
        }
    }
}

/// An owned quantised weight (tests and tools build these from f32 values).
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedWeight {
    pub rows: usize,
    pub cols: usize,
    pub format: OwnedFormat,
    pub values: Vec<u8>,
    pub scales: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnedFormat {
    Bf16,
    Fp8,
    Fp4,
}

impl OwnedWeight {
    /// Quantise `[rows, cols]` f32 values as a checkpoint would store them.
    pub fn quantize(m: &HostMatrix, format: OwnedFormat) -> Self {
        let (rows, cols) = (m.rows, m.cols);
        let (values, scales) = match format {
            OwnedFormat::Bf16 => {
                (m.data.iter().flat_map(|&v| quant::f32_to_bf16(v).to_le_bytes()).collect(), Vec::new())
            }
            OwnedFormat::Fp8 => quant::quantize_fp8_blocks(&m.data, rows, cols, FP8_BLOCK),
            OwnedFormat::Fp4 => quant::quantize_fp4_groups(&m.data, rows, cols, FP4_GROUP),
        };
        OwnedWeight { rows, cols, format, values, scales }
    }

    pub fn view(&self) -> WeightView<'_> {
        let data = match self.format {
            OwnedFormat::Bf16 => Stored::Bf16(&self.values),
            OwnedFormat::Fp8 => Stored::Fp8 { codes: &self.values, scales: Scales::Ue8m0(&self.scales) },
            OwnedFormat::Fp4 => Stored::Fp4 { packed: &self.values, scales: Scales::Ue8m0(&self.scales) },
        };
        WeightView { rows: self.rows, cols: self.cols, data }
    }

    /// The values the stored weight means, as an f32 matrix.
    pub fn dequantized(&self) -> HostMatrix {
        HostMatrix::new(self.rows, self.cols, self.view().dequantize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(rows: usize, cols: usize) -> HostMatrix {
        let data = (0..rows * cols).map(|i| ((i * 7919 % 997) as f32 / 498.5 - 1.0) * 0.37).collect();
        HostMatrix::new(rows, cols, data)
    }

    #[test]
    fn dequantise_matches_the_quant_module() {
        let m = host(130, 200);
        let q = OwnedWeight::quantize(&m, OwnedFormat::Fp8);
        let s: Vec<f32> = q.scales.iter().map(|&b| quant::ue8m0_to_f32(b)).collect();
        let want = quant::dequant_fp8_blocks(&q.values, 130, 200, &s, (2, 2), FP8_BLOCK).unwrap();
        q.view().validate().unwrap();
        assert_eq!(q.view().dequantize(), want);

        let q = OwnedWeight::quantize(&m, OwnedFormat::Fp4);
        let s: Vec<f32> = q.scales.iter().map(|&b| quant::ue8m0_to_f32(b)).collect();
        let want = quant::dequant_fp4_groups(&q.values, 130, 200, &s, (130, 7), FP4_GROUP).unwrap();
        q.view().validate().unwrap();
        assert_eq!(q.view().dequantize(), want);
        assert!(q.view().exact_in_bf16());
    }

    #[test]
    fn validation_names_the_mismatch() {
        let m = host(4, 64);
        let q = OwnedWeight::quantize(&m, OwnedFormat::Fp4);
        let mut v = q.view();
        v.rows = 5;
        assert!(matches!(v.validate(), Err(QuantError::Fp4Len { want: 160, got: 128, .. })));
        let short = WeightView {
            rows: 4,
            cols: 64,
            data: Stored::Fp4 { packed: &q.values, scales: Scales::Ue8m0(&q.scales[..7]) },
        };
        assert!(matches!(short.validate(), Err(QuantError::ScaleGrid { want: (4, 2), .. })));
    }

    #[test]
    fn float_scales_convert_to_ue8m0_only_when_powers_of_two() {
        assert_eq!(Scales::F32(vec![1.0, 0.25, 8.0]).to_ue8m0(), Some(vec![127, 125, 130]));
        assert_eq!(Scales::F32(vec![1.0, 0.3]).to_ue8m0(), None);
        assert_eq!(Scales::F32(vec![0.0]).to_ue8m0(), None);
    }

    #[test]
    fn f32_views_of_host_matrices_round_trip() {
        let m = host(3, 5);
        let v = WeightView::from(&m);
        v.validate().unwrap();
        assert_eq!(v.dequantize(), m.data);
        assert!(!v.exact_in_bf16());
    }
}
