//! Helpers the GPU test files share: the device they run on and their prompts.
#![allow(dead_code)] // each test file uses its own subset

#[cfg(feature = "cuda")]
use engine::CudaBackend;

/// GPU 0 with split activations (`Activations::Split`: these suites hold the GPU to
/// f32 distance from the CPU engine), or None (after saying the test is skipped) on a
/// machine without one.
#[cfg(feature = "cuda")]
pub fn gpu(test: &str) -> Option<CudaBackend> {
    gpu_in(test, engine::Activations::Split)
}

/// [`gpu`] whose bf16 products take `activations` (`Bf16`: the serving default).
#[cfg(feature = "cuda")]
pub fn gpu_in(test: &str, activations: engine::Activations) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(mut b) => {
            b.set_activations(activations);
            Some(b)
        }
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

/// max|got − want| over a row, a NaN in `got` counting as infinitely far.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter().zip(want).map(|(a, b)| if a.is_nan() { f32::INFINITY } else { (a - b).abs() }).fold(0f32, f32::max)
}

/// The greedy token of a row of logits (the engine's sampler's rule).
pub fn argmax(row: &[f32]) -> u32 {
    engine::sampling::argmax(row)
}

/// How far logits rows computed in bf16 activations (`Activations::Bf16`, the serving
/// default) may lie from a reference computed otherwise — the f32 CPU engine, or the same
/// precision over another layout of GPUs, whose different summation orders each bf16
/// rounding then carries on. Each row's error is max|Δ| over the block's largest reference
/// logit. A rounding of 2^-9 moves the router's and the indexer's inputs enough to change
/// the experts or keys of every row whose scores lie closer than that, and on random
/// models such a row moves by up to ~0.7 (the small preset against the CPU on an H200:
/// median 8.7e-3–9.0e-3, 90th percentile 1.9e-2–2.0e-2, 99th 0.35–0.36, worst 0.48–0.71;
/// greedy picks equal in 94%), so the bounds are on the distribution. A wrong kernel (a
/// swapped fragment, a lost scale, the wrong plane) moves every row by order one.
pub const BF16_ACT_MEDIAN: f32 = 2e-2;
pub const BF16_ACT_P90: f32 = 5e-2;
/// Any row: NaN or garbage, not a routing flip.
pub const BF16_ACT_MAX: f32 = 2.0;
pub const BF16_ACT_SAME_PICKS: f64 = 0.85;

/// Rows gathered for the bf16-activation bounds above.
#[derive(Default)]
pub struct Bf16Rows {
    errors: Vec<f32>,
    same_picks: usize,
}

impl Bf16Rows {
    /// One row against its reference row; `scale` is the reference block's max|logit|.
    pub fn row(&mut self, got: &[f32], want: &[f32], scale: f32) {
        self.errors.push(max_abs_diff(got, want) / scale.max(1e-30));
        self.same_picks += usize::from(argmax(got) == argmax(want));
    }

    /// Prints the distribution and asserts the bounds.
    pub fn finish(mut self, what: &str) {
        assert!(!self.errors.is_empty(), "{what}: no rows compared");
        self.errors.sort_by(f32::total_cmp);
        let rows = self.errors.len();
        let at = |q: f64| self.errors[((rows - 1) as f64 * q).round() as usize];
        let (median, p90, max) = (at(0.5), at(0.9), self.errors[rows - 1]);
        let same = self.same_picks as f64 / rows as f64;
        eprintln!(
            "PARITY {what}: {rows} rows, error median {median:.2e} p90 {p90:.2e} p99 {:.2e} max {max:.2e}; greedy \
             picks equal in {} ({:.1}%)",
            at(0.99),
            self.same_picks,
            100.0 * same
        );
        assert!(median <= BF16_ACT_MEDIAN, "{what}: median row {median:.3e} above {BF16_ACT_MEDIAN:.0e}");
        assert!(p90 <= BF16_ACT_P90, "{what}: 90th percentile row {p90:.3e} above {BF16_ACT_P90:.0e}");
        assert!(max <= BF16_ACT_MAX, "{what}: a row {max:.3e} off, above {BF16_ACT_MAX}");
        assert!(
            same >= BF16_ACT_SAME_PICKS,
            "{what}: greedy picks equal in {:.1}% of rows, fewer than {:.0}%",
            100.0 * same,
            100.0 * BF16_ACT_SAME_PICKS
        );
    }
}
