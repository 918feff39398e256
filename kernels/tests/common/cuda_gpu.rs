//! The GPU the CUDA test binaries share (included by `parity.rs` and `cuda_parity`).
//!
//! The suites hold the GPU to f32 distance from the CPU backend, so [`gpu`] is a backend
//! whose bf16 products take split activations (`Activations::Split`); tests of the
//! reference model's one-rounding precision ask [`gpu_in`] for `Activations::Bf16`.
//!
//! A backend issues one thread's ops at a time, as the engine does: the ops that use its
//! scratch buffers (the long-row top-k's histograms and tickets across three launches,
//! split-K partials) share them, and two threads interleaving those launches on the
//! backend's stream mix their sums (the likely cause of one failure of
//! `cuda_topk_long_rows_equal_the_definition` with the whole binary on 32 threads,
//! which passed alone three times of three). Tests run on several threads, so each
//! holds its backend for its whole run ([`Held`]: `let Some(g) = gpu(test) else { return };
//! let g = &*g;` — the shadowed value lives, holding the turn, to the end of the scope);
//! tests of different binaries run in different processes.

use std::sync::{Mutex, MutexGuard, OnceLock};

use kernels::Activations;
use kernels::cuda::CudaBackend;

/// A test's turn on the shared backends (one turn for both precisions).
static TURN: Mutex<()> = Mutex::new(());

/// The backend, held for the test's run (released when dropped).
pub struct Held {
    _turn: MutexGuard<'static, ()>,
    gpu: &'static CudaBackend,
}

impl std::ops::Deref for Held {
    type Target = CudaBackend;
    fn deref(&self) -> &CudaBackend {
        self.gpu
    }
}

/// The split-activations backend: [`gpu_in`]`(test, Activations::Split)`.
pub fn gpu(test: &str) -> Option<Held> {
    gpu_in(test, Activations::Split)
}

/// One backend a precision for every test of the binary (kernels compile once), held
/// until the returned value drops; `None`, with a note on stderr, where there is no
/// usable GPU.
pub fn gpu_in(test: &str, activations: Activations) -> Option<Held> {
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
        // A test that failed while holding its turn leaves the lock poisoned; the next
        // test's turn is still good.
        Ok(gpu) => Some(Held { _turn: TURN.lock().unwrap_or_else(|e| e.into_inner()), gpu }),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}
