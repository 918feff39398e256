//! The precision a backend's bf16 tensor-core products take their activations in
//! ([`crate::Activations`]): `cublas_bf16`, `moe_fp4wg`'s parts, `matmul_many` and the
//! tensor-core attention read `Gpu::activations`.

use super::CudaBackend;
use crate::Activations;

impl CudaBackend {
    /// The activations' precision of this backend's bf16 tensor-core products (the
    /// process default, [`Activations::process_default`], unless set).
    pub fn activations(&self) -> Activations {
        self.gpu.activations
    }

    /// Sets [`activations`](Self::activations). Before weights load and steps run: a
    /// decode step recorded as a CUDA graph keeps the kernels it was recorded with.
    pub fn set_activations(&mut self, a: Activations) {
        self.gpu.activations = a;
    }
}
