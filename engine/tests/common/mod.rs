//! Helpers the GPU test files share: the device they run on and their prompts.
#![allow(dead_code)] // each test file uses its own subset

#[cfg(feature = "cuda")]
use engine::CudaBackend;

/// GPU 0, or None (after saying the test is skipped) on a machine without one.
#[cfg(feature = "cuda")]
pub fn gpu(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}

/// Deterministic pseudo-random token ids below `vocab` (an LCG; the values only need to
/// vary with `salt`).
pub fn prompt(len: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// The greedy token of a row of logits (the engine's sampler's rule).
pub fn argmax(row: &[f32]) -> u32 {
    engine::sampling::argmax(row)
}
