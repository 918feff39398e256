//! A cuBLAS product as a value: everything one library call is given (operand addresses,
//! shapes, types, `beta`), so that a decode step's recording can hold it beside its
//! kernel launches, compare it, capture it into the step's graph on the lane it was
//! recorded on, or issue it now (`step_graph.rs`).
//!
//! cuBLAS kernels can be captured when the library allocates nothing during the
//! capture: every handle this backend makes gets its own workspace up front
//! ([`set_workspace`]), one a stream, so two lanes of a captured branch never share one.

use std::ffi::c_void;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cublasStatus_t, cudaDataType,
};
use cudarc::driver::{CudaSlice, CudaStream};

/// Workspace of each cuBLAS handle: what cuBLAS itself uses by default on Hopper, so
/// the algorithms it picks are those it picked before the workspace was explicit.
const WORKSPACE_BYTES: usize = 32 << 20;

/// One cuBLAS product, in cuBLAS's column-major terms.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum BlasOp {
    /// `groups` products `C_g(m × n) = A_gᵀ(m × k) · B_g(k × n) + beta · C_g`
    /// (`cublasGemmStridedBatchedEx`): A row-major `[m, k]` weights `m·k` apart, B `n`
    /// rows of `ldb` values whose group g starts at column g·k, C `n` rows of `ldc`
    /// values (`c_type`: f32, or bf16 rounded from the f32 sums) whose group g starts at
    /// column g·m.
    Strided {
        a: u64,
        a_type: cudaDataType,
        b: u64,
        b_type: cudaDataType,
        ldb: usize,
        c: u64,
        c_type: cudaDataType,
        ldc: usize,
        m: usize,
        n: usize,
        k: usize,
        groups: usize,
        beta: f32,
    },
    /// `batch` products `C_i(m × n) = A_iᵀ · B_i` (`cublasGemmBatchedEx`) over device
    /// arrays of A, B and C pointers: A_i row-major `[m, k]` bf16, B_i `n` rows of `k`
    /// bf16, C_i `n` rows of `m` f32.
    PointerArrays { arrays: [u64; 3], m: usize, n: usize, k: usize, batch: usize },
}

impl BlasOp {
    /// The words two equal calls share (appended to a recorded segment's key).
    pub(crate) fn key(&self, key: &mut Vec<u64>) {
        match *self {
            BlasOp::Strided { a, a_type, b, b_type, ldb, c, c_type, ldc, m, n, k, groups, beta } => key
                .extend_from_slice(&[
                    7,
                    a,
                    a_type as u64,
                    b,
                    b_type as u64,
                    ldb as u64,
                    c,
                    c_type as u64,
                    ldc as u64,
                    m as u64,
                    n as u64,
                    k as u64,
                    groups as u64,
                    u64::from(beta.to_bits()),
                ]),
            BlasOp::PointerArrays { arrays, m, n, k, batch } => {
                key.extend_from_slice(&[8, arrays[0], arrays[1], arrays[2], m as u64, n as u64, k as u64, batch as u64])
            }
        }
    }

    /// Issue the call on the stream `handle` is bound to.
    ///
    /// # Safety
    /// Every address must be live device memory of the sizes the variant describes (the
    /// pointer arrays' entries too), ordered before this call on the handle's stream.
    pub(crate) unsafe fn issue(&self, handle: cublasHandle_t) -> Result<(), CublasError> {
        let alpha = 1f32;
        let (t, n_op) = (cublasOperation_t::CUBLAS_OP_T, cublasOperation_t::CUBLAS_OP_N);
        let (compute, algo) = (cublasComputeType_t::CUBLAS_COMPUTE_32F, cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT);
        let one = &alpha as *const f32 as *const c_void;
        match *self {
            BlasOp::Strided { a, a_type, b, b_type, ldb, c, c_type, ldc, m, n, k, groups, beta } => {
                // SAFETY: the caller's contract above.
                unsafe {
                    cudarc::cublas::result::gemm_strided_batched_ex(
                        handle,
                        t,
                        n_op,
                        m as i32,
                        n as i32,
                        k as i32,
                        one,
                        a as *const c_void,
                        a_type,
                        k as i32,
                        (m * k) as i64,
                        b as *const c_void,
                        b_type,
                        ldb as i32,
                        k as i64,
                        &beta as *const f32 as *const c_void,
                        c as *mut c_void,
                        c_type,
                        ldc as i32,
                        m as i64,
                        groups as i32,
                        compute,
                        algo,
                    )
                }
            }
            BlasOp::PointerArrays { arrays, m, n, k, batch } => {
                let zero = 0f32;
                // SAFETY: the caller's contract above.
                let status = unsafe {
                    cudarc::cublas::sys::cublasGemmBatchedEx(
                        handle,
                        t,
                        n_op,
                        m as i32,
                        n as i32,
                        k as i32,
                        one,
                        arrays[0] as *const *const c_void,
                        cudaDataType::CUDA_R_16BF,
                        k as i32,
                        arrays[1] as *const *const c_void,
                        cudaDataType::CUDA_R_16BF,
                        k as i32,
                        &zero as *const f32 as *const c_void,
                        arrays[2] as *const *mut c_void,
                        cudaDataType::CUDA_R_32F,
                        m as i32,
                        batch as i32,
                        compute,
                        algo,
                    )
                };
                match status {
                    cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
                    other => Err(CublasError(other)),
                }
            }
        }
    }
}

/// A cuBLAS handle on `stream` with its own workspace (kept with it: the handle and every
/// graph captured from it use that memory).
pub(crate) fn handle_with_workspace(stream: &std::sync::Arc<CudaStream>) -> Result<BlasHandle, String> {
    let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("cuBLAS handle: {e:?}"))?;
    let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES).map_err(|e| format!("cuBLAS workspace: {e:?}"))?;
    set_workspace(&blas, &workspace)?;
    Ok(BlasHandle { blas, _workspace: workspace })
}

/// Point `blas` at `workspace` (cuBLAS then allocates nothing of its own, which a stream
/// capture requires).
fn set_workspace(blas: &CudaBlas, workspace: &CudaSlice<u8>) -> Result<(), String> {
    use cudarc::driver::DevicePtr;
    let (ptr, _sync) = workspace.device_ptr(workspace.stream());
    // SAFETY: the workspace is a live device allocation of its length on the handle's
    // context, kept as long as the handle (`BlasHandle`).
    let status =
        unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut c_void, workspace.len()) };
    match status {
        cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        other => Err(format!("cuBLAS workspace of {} MiB refused: {other:?}", workspace.len() >> 20)),
    }
}

/// A cuBLAS handle and the workspace it was given.
pub(crate) struct BlasHandle {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
}

impl BlasHandle {
    pub(crate) fn handle(&self) -> cublasHandle_t {
        *self.blas.handle()
    }
}
