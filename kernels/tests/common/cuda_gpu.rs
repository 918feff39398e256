//! The GPU the CUDA test binaries share (included by `parity.rs` and `cuda_parity`).
//!
//! The suites hold the GPU to f32 distance from the CPU backend, so [`gpu`] is a backend
//! whose bf16 products take split activations (`Activations::Split`); tests of the
//! reference model's one-rounding precision ask [`gpu_in`] for `Activations::Bf16`.

use std::sync::OnceLock;

use kernels::Activations;
use kernels::cuda::CudaBackend;

/// The split-activations backend: [`gpu_in`]`(test, Activations::Split)`.
pub fn gpu(test: &str) -> Option<&'static CudaBackend> {
    gpu_in(test, Activations::Split)
}

/// One backend a precision for every test of the binary (kernels compile once); `None`,
/// with a note on stderr, where there is no usable GPU.
pub fn gpu_in(test: &str, activations: Activations) -> Option<&'static CudaBackend> {
    static B: [OnceLock<Result<CudaBackend, String>>; 2] = [OnceLock::new(), OnceLock::new()];
    let slot = match activations {
        Activations::Split => 0,
        Activations::Bf16 => 1,
    };
    let made = B[slot].get_or_init(|| {
        let mut b = CudaBackend::new(0).map_err(|e| e.to_string())?;
        b.set_activations(activations);
        Ok(b)
    });
    match made {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}
