//! What the CUDA backend's buffers are: f32 activations, weights (f32, bf16, or FP8
//! with block scales), entry storage in an [`EntryDtype`], and index lists, all in
//! device memory.

use cudarc::driver::CudaSlice;
use rayon::prelude::*;

use super::runtime::Gpu;
use crate::EntryDtype;
use crate::backend::HostMatrix;
use crate::quant::{f32_to_bf16, f32_to_fp8_e4m3, fp8_e4m3_to_f32, ue8m0_for, ue8m0_to_f32};

/// Dense f32 activations.
pub struct CudaBuf {
    pub(crate) mem: CudaSlice<f32>,
    pub(crate) len: usize,
}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuf({} f32)", self.len)
    }
}

impl CudaBuf {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// How a weight's values are stored on the device.
pub(crate) enum WeightData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    /// FP8 e4m3 codes and one f32 (power-of-two) scale per 128×128 block.
    Fp8 {
        codes: CudaSlice<u8>,
        scales: CudaSlice<f32>,
    },
}

/// `[rows, cols]` row-major (torch `Linear` layout).
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    pub(crate) data: WeightData,
}

impl std::fmt::Debug for CudaWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaWeight({}x{} {})", self.rows, self.cols, self.format())
    }
}

impl CudaWeight {
    /// "f32", "bf16" or "fp8".
    pub fn format(&self) -> &'static str {
        match self.data {
            WeightData::F32(_) => "f32",
            WeightData::Bf16(_) => "bf16",
            WeightData::Fp8 { .. } => "fp8",
        }
    }

    /// Bytes the device holds for this weight (what a product streams).
    pub fn device_bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(_) => self.rows * self.cols * 4,
            WeightData::Bf16(_) => self.rows * self.cols * 2,
            WeightData::Fp8 { .. } => self.rows * self.cols + self.rows.div_ceil(128) * self.cols.div_ceil(128) * 4,
        }
    }
}

/// Whether FP8 storage is allowed (`SLUICE_CUDA_FP8=0` turns it off).
fn fp8_enabled() -> bool {
    std::env::var("SLUICE_CUDA_FP8").map(|v| v != "0").unwrap_or(true)
}

/// FP8 codes and block scales if every value is exactly an e4m3 value times its
/// 128×128 block's power-of-two scale (what FP8 checkpoints dequantise to); `None` as
/// soon as one value is not.
fn exact_fp8(m: &HostMatrix) -> Option<(Vec<u8>, Vec<f32>)> {
    const B: usize = 128;
    let (rows, cols) = (m.rows, m.cols);
    let grid = (rows.div_ceil(B), cols.div_ceil(B));
    let scales: Vec<f32> = (0..grid.0 * grid.1)
        .into_par_iter()
        .map(|bi| {
            let (br, bc) = (bi / grid.1, bi % grid.1);
            let mut amax = 0f32;
            for r in br * B..((br + 1) * B).min(rows) {
                for c in bc * B..((bc + 1) * B).min(cols) {
                    amax = amax.max(m.data[r * cols + c].abs());
                }
            }
            ue8m0_to_f32(ue8m0_for(amax, 448.0))
        })
        .collect();
    let codes: Option<Vec<u8>> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let mut row = Vec::with_capacity(cols);
            for c in 0..cols {
                let v = m.data[r * cols + c];
                let s = scales[(r / B) * grid.1 + c / B];
                let code = f32_to_fp8_e4m3(v / s);
                if fp8_e4m3_to_f32(code) * s != v {
                    return None;
                }
                row.push(code);
            }
            Some(row)
        })
        .collect::<Option<Vec<Vec<u8>>>>()
        .map(|v| v.concat());
    codes.map(|c| (c, scales))
}

pub(crate) fn upload_weight(gpu: &Gpu, m: HostMatrix) -> CudaWeight {
    let (rows, cols) = (m.rows, m.cols);
    let exact_bf16 = m.data.par_iter().all(|&v| f32::from_bits((f32_to_bf16(v) as u32) << 16).to_bits() == v.to_bits());
    let data = if !exact_bf16 {
        WeightData::F32(gpu.upload(&m.data))
    } else if fp8_enabled()
        && cols.is_multiple_of(16)
        && rows * cols >= 128 * 128
        && let Some((codes, scales)) = exact_fp8(&m)
    {
        WeightData::Fp8 { codes: gpu.upload(&codes), scales: gpu.upload(&scales) }
    } else {
        let bits: Vec<u16> = m.data.par_iter().map(|&v| f32_to_bf16(v)).collect();
        WeightData::Bf16(gpu.upload(&bits))
    };
    CudaWeight { rows, cols, data }
}

/// Entry storage: pages, window rings, or (always f32) compressor slots.
pub struct CudaKv {
    pub(crate) mem: CudaSlice<u8>,
    pub(crate) dtype: EntryDtype,
    pub(crate) len: usize,
}

impl std::fmt::Debug for CudaKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaKv({} x {}, device)", self.len, self.dtype.name())
    }
}

impl CudaKv {
    pub fn dtype(&self) -> EntryDtype {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Integer indices (the indexer's selection).
pub struct CudaIdx {
    pub(crate) mem: CudaSlice<i32>,
    pub(crate) len: usize,
}

impl CudaIdx {
    /// Indices from the host (tests and benchmarks build selections this way).
    pub fn from_host(b: &super::CudaBackend, v: &[i32]) -> Self {
        CudaIdx { mem: b.gpu().upload(v), len: v.len() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for CudaIdx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaIdx({})", self.len)
    }
}

/// Code of an entry dtype as the kernels read it.
pub(crate) fn dtype_code(d: EntryDtype) -> i32 {
    match d {
        EntryDtype::F32 => 0,
        EntryDtype::Bf16 => 1,
        EntryDtype::Fp8 => 2,
    }
}

/// A host region page-locked for the device (`cuMemHostRegister`), unregistered on
/// drop. Holds the context so it outlives the backend that made it.
pub(crate) struct HostRegistration {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    ptr: usize,
}

impl HostRegistration {
    /// Pin `region`; `None` when the driver refuses (the caller says so in its log).
    pub fn new(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, region: &[u8]) -> Option<Self> {
        use cudarc::driver::sys;
        if region.is_empty() {
            return None;
        }
        ctx.bind_to_thread().ok()?;
        let ptr = region.as_ptr() as *mut std::ffi::c_void;
        // SAFETY: `region` is live host memory of `region.len()` bytes; the caller keeps
        // it alive while this registration exists (Backend::pin_host's contract).
        let r = unsafe { sys::cuMemHostRegister_v2(ptr, region.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        Some(HostRegistration { ctx: ctx.clone(), ptr: ptr as usize })
    }
}

impl crate::backend::HostPin for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `new` in this context and not since.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
        }
    }
}
