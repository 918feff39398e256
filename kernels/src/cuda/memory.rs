//! What the CUDA backend's buffers are: f32 activations, weights (f32, bf16, or FP8
//! with block scales), entry storage in an [`EntryDtype`], and index lists, all in
//! device memory.

use cudarc::driver::CudaSlice;

use super::arena::DevBuf;
use super::runtime::Gpu;
use super::upload::{STAGE_MIN_BYTES, Staging, queue_copy};
use crate::EntryDtype;
use crate::quant::{f16_to_f32, f32_to_bf16};
use crate::stored::{FP4_GROUP, FP8_BLOCK, Stored, WeightView};

/// Dense f32 activations.
pub struct CudaBuf {
    pub(crate) mem: DevBuf<f32>,
    pub(crate) len: usize,
    /// The same values rounded once to bf16 (`[rows, cols]` as `mem`), written beside them
    /// by the kernel that wrote them, for the products that read bf16 rows (cuBLAS with bf16
    /// activations) instead of rounding them again: a prefill's sub-block input, from
    /// `hc_collapse_rows` (`hc.rs::finish`, which replaces or drops it whenever it writes
    /// the buffer). None for every other buffer. Only the mHC finish writes a buffer that
    /// carries one (the engine reads a sub-block's input until the next boundary
    /// rewrites it); a writer of such a buffer must drop it first.
    pub(crate) bf16: Option<DevBuf<u16>>,
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

/// How a weight's values are stored on the device: in the checkpoint's format.
pub(crate) enum WeightData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    /// FP8 e4m3 codes and one f32 (power-of-two) scale per 128×128 block. `bf16_exact`:
    /// every scale is a power of two in 2^-100..2^7, where the prefill products' bf16
    /// scaling of the codes is exact (`moe_fp4wg`).
    Fp8 {
        codes: CudaSlice<u8>,
        scales: CudaSlice<f32>,
        bf16_exact: bool,
    },
    /// FP4 e2m1 packed two per byte (low nibble first) and one ue8m0 scale byte per 32
    /// inputs of a row. `tc`: every scale lies where the tensor-core gemv's f16 scaling
    /// is exact (2^-23 ..= 2^1), so decode products may use it.
    Fp4 {
        packed: CudaSlice<u8>,
        scales: CudaSlice<u8>,
        tc: bool,
    },
}

/// `[rows, cols]` row-major (torch `Linear` layout).
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    pub(crate) data: WeightData,
    /// The device addresses of the values and of the scales (0 without), read once: a
    /// decode step names every expert's (a routed layer's weight table, `moe.rs`).
    ptrs: (u64, u64),
}

impl std::fmt::Debug for CudaWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaWeight({}x{} {})", self.rows, self.cols, self.format())
    }
}

impl CudaWeight {
    pub(crate) fn new(gpu: &Gpu, rows: usize, cols: usize, data: WeightData) -> Self {
        let ptrs = match &data {
            WeightData::F32(d) => (gpu.ptr(d), 0),
            WeightData::Bf16(d) => (gpu.ptr(d), 0),
            WeightData::Fp8 { codes, scales, .. } => (gpu.ptr(codes), gpu.ptr(scales)),
            WeightData::Fp4 { packed, scales, .. } => (gpu.ptr(packed), gpu.ptr(scales)),
        };
        CudaWeight { rows, cols, data, ptrs }
    }

    /// Device addresses of the values and of the scales (0 for F32 and BF16).
    pub(crate) fn ptrs(&self) -> (u64, u64) {
        self.ptrs
    }

    /// "f32", "bf16", "fp8" or "fp4".
    pub fn format(&self) -> &'static str {
        match self.data {
            WeightData::F32(_) => "f32",
            WeightData::Bf16(_) => "bf16",
            WeightData::Fp8 { .. } => "fp8",
            WeightData::Fp4 { .. } => "fp4",
        }
    }

    /// Bytes the device holds for this weight (what a product streams).
    pub fn device_bytes(&self) -> usize {
        let (r, c) = (self.rows, self.cols);
        match &self.data {
            WeightData::F32(_) => r * c * 4,
            WeightData::Bf16(_) => r * c * 2,
            WeightData::Fp8 { .. } => r * c + r.div_ceil(FP8_BLOCK.0) * c.div_ceil(FP8_BLOCK.1) * 4,
            WeightData::Fp4 { .. } => r * c / 2 + r * c.div_ceil(FP4_GROUP),
        }
    }
}

/// ue8m0 bytes of the FP4 scales the tensor-core gemv multiplies in f16 exactly
/// (2^-23 ..= 2^1: the e2m1 values times them are f16 values).
pub(crate) const FP4_TC_SCALES: (u8, u8) = (104, 128);

/// Device memory for `len` bytes of `T`s, filled from `fill(offset, piece)` through the
/// pinned staging pool (large sources) or one pageable copy (small ones).
fn staged<T: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    staging: &Staging,
    len: usize,
    mut fill: impl FnMut(usize, &mut [u8]),
) -> CudaSlice<T> {
    let bytes = len * std::mem::size_of::<T>();
    let dst = gpu.alloc_owned::<T>(len);
    if bytes < STAGE_MIN_BYTES {
        let mut host = vec![0u8; bytes];
        fill(0, &mut host);
        queue_copy(&gpu.stream, gpu.ptr(&dst), &host);
    } else {
        staging.copy(gpu, gpu.ptr(&dst), bytes, &mut fill);
    }
    dst
}

/// Copy `src[offset..offset + piece.len()]` into `piece`.
fn slice_fill(src: &[u8]) -> impl FnMut(usize, &mut [u8]) + '_ {
    move |at, piece| piece.copy_from_slice(&src[at..at + piece.len()])
}

/// Upload a stored weight in its own format (FP8 scales widened to f32, float scales of
/// FP4 narrowed to ue8m0); F32 becomes BF16 when every value is exactly a bf16 value
/// (it then means the same numbers for half the bytes), F16 becomes F32.
pub(crate) fn upload_weight(gpu: &Gpu, staging: &Staging, w: &WeightView<'_>) -> CudaWeight {
    let (rows, cols) = (w.rows, w.cols);
    let n = rows * cols;
    let data = match &w.data {
        Stored::Bf16(b) => WeightData::Bf16(staged(gpu, staging, n, slice_fill(b))),
        Stored::F32(b) if w.exact_in_bf16() => WeightData::Bf16(staged(gpu, staging, n, |at, piece| {
            // Piece byte `at` is bf16 element `at / 2`, i.e. f32 element `at / 2`.
            let first = at / 2;
            for (i, out) in piece.chunks_exact_mut(2).enumerate() {
                let j = 4 * (first + i);
                let v = f32::from_le_bytes([b[j], b[j + 1], b[j + 2], b[j + 3]]);
                out.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        })),
        Stored::F32(b) => WeightData::F32(staged(gpu, staging, n, slice_fill(b))),
        Stored::F16(b) => WeightData::F32(staged(gpu, staging, n, |at, piece| {
            let first = at / 4;
            for (i, out) in piece.chunks_exact_mut(4).enumerate() {
                let j = 2 * (first + i);
                out.copy_from_slice(&f16_to_f32(u16::from_le_bytes([b[j], b[j + 1]])).to_le_bytes());
            }
        })),
        Stored::Fp8 { codes, scales } => WeightData::Fp8 {
            codes: staged(gpu, staging, n, slice_fill(codes)),
            bf16_exact: scales.to_ue8m0().is_some_and(|b| b.iter().all(|&e| (27..=134).contains(&e))),
            scales: gpu.upload_owned(&scales.to_f32()),
        },
        Stored::Fp4 { packed, scales } => match scales.to_ue8m0() {
            Some(s) => WeightData::Fp4 {
                tc: s.iter().all(|&b| (FP4_TC_SCALES.0..=FP4_TC_SCALES.1).contains(&b)),
                packed: staged(gpu, staging, n / 2, slice_fill(packed)),
                scales: gpu.upload_owned(&s),
            },
            None => {
                // Not DeepSeek's format (scales that are not powers of two): the kernels
                // read ue8m0 only, so this weight is widened to bf16 (exact) instead.
                tracing::warn!(rows, cols, "FP4 weight with non-power-of-two scales: stored as bf16 on the device");
                let bits: Vec<u16> = w.dequantize().iter().map(|&v| f32_to_bf16(v)).collect();
                WeightData::Bf16(gpu.upload_owned(&bits))
            }
        },
    };
    CudaWeight::new(gpu, rows, cols, data)
}

/// Entry storage: pages, window rings, or (always f32) compressor slots.
pub struct CudaKv {
    /// Shared so that a transport's registration of this memory can keep it allocated
    /// ([`CudaKvMemory`]); writes go by address (`Gpu::write_raw`), never through
    /// `&mut` to the slice.
    pub(crate) mem: std::sync::Arc<super::kv_buffer::KvBuffer>,
    pub(crate) dtype: EntryDtype,
    pub(crate) len: usize,
}

/// A KV storage's device memory as a transport holds it: the allocation stays alive for
/// as long as the handle does.
pub struct CudaKvMemory {
    pub(crate) _mem: std::sync::Arc<super::kv_buffer::KvBuffer>,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
}

// SAFETY: ptr..ptr + len is the allocation `_mem` holds (taken from it at creation), on
// device `ordinal`; the Arc keeps it allocated until the handle is dropped.
unsafe impl crate::backend::DeviceMemory for CudaKvMemory {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn make_current(&self) {
        // A failure here surfaces as the transport's own error on the next call.
        let _ = self._mem.context().bind_to_thread();
    }
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
    pub(crate) mem: DevBuf<i32>,
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
        // Pinning host memory may synchronize the context: not beside a capture.
        let _sync = super::capture_lock::may_sync(ctx.ordinal());
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
            let _sync = super::capture_lock::may_sync(self.ctx.ordinal());
            // SAFETY: `ptr` was registered by `new` in this context and not since.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
        }
    }
}
