//! The GPU the CUDA test binaries share (included by `parity.rs` and `cuda_parity`).

use std::sync::OnceLock;

use kernels::cuda::CudaBackend;

/// One backend for every test of the binary (kernels compile once); `None`, with a note
/// on stderr, where there is no usable GPU.
pub fn gpu(test: &str) -> Option<&'static CudaBackend> {
    static B: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    match B.get_or_init(|| CudaBackend::new(0).map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}
