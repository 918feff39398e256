//! A worker's first requests without the one-time costs of a GPU engine.
//!
//! A CUDA engine pays, on its first steps of each kind, for work no later step repeats:
//! cuBLAS loads a kernel at its first use (lazy loading; tens of milliseconds for the first
//! products of a new prefill length), pinned read buffers are allocated at the first large
//! read, and decode steps are captured as CUDA graphs at their second sighting. Without a
//! warm-up the first requests a worker serves carry those costs in their time to first
//! token. [`Engine::warm_up`] runs short prefills and a few greedy decode steps of one
//! sequence of made-up tokens, then releases it; nothing of it stays in the pool, and the
//! prefix caches (kept by the workers, not the engine) never see it.

use std::time::Instant;

use kernels::Backend;

use crate::device::AnyEngine;
use crate::engine::{Engine, Logits};
use crate::error::EngineError;

/// What a warm-up runs: one prefill of each prompt length (each clamped to the engine's
/// chunk) and then `decode_steps` batch-1 decode steps after the last of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmUpPlan {
    pub prompts: Vec<usize>,
    pub decode_steps: usize,
}

impl Default for WarmUpPlan {
    /// A single-token-like prompt and a typical chat prompt (the decode-sized and the
    /// tiled product paths), and three decode steps: recorded, captured, replayed.
    fn default() -> Self {
        WarmUpPlan { prompts: vec![5, 300], decode_steps: 3 }
    }
}

/// What a warm-up did.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmUpReport {
    pub prompts: Vec<usize>,
    pub decode_steps: usize,
    pub seconds: f64,
}

impl<B: Backend> Engine<B> {
    /// Run `plan` on a sequence of made-up tokens and release it. Fails (with everything
    /// released) only where a request of the same size would.
    pub fn warm_up(&mut self, plan: &WarmUpPlan) -> Result<WarmUpReport, EngineError> {
        let started = Instant::now();
        let vocab = self.config().vocab_size.max(1);
        let chunk = self.options.max_chunk_tokens.max(1);
        let prompts: Vec<usize> = plan.prompts.iter().map(|&n| n.clamp(1, chunk)).collect();
        let token = |i: usize| ((i * 7919 + 13) % vocab) as u32;
        for (p, &n) in prompts.iter().enumerate() {
            let mut seq = self.open_sequence()?;
            let tokens: Vec<u32> = (0..n).map(|i| token(i + p)).collect();
            let mut run = || -> Result<(), EngineError> {
                self.prefill(&mut seq, &tokens, Logits::Last)?;
                if p + 1 == prompts.len() {
                    let mut next = token(n);
                    for _ in 0..plan.decode_steps {
                        let out = self.decode_readout(&mut [&mut seq], &[next], &[false])?;
                        next = out[0].token;
                    }
                }
                Ok(())
            };
            let result = run();
            self.release(seq);
            result?;
        }
        Ok(WarmUpReport { prompts, decode_steps: plan.decode_steps, seconds: started.elapsed().as_secs_f64() })
    }
}

impl AnyEngine {
    /// [`Engine::warm_up`] on GPU engines, logged; None on CPU engines, which have no
    /// one-time costs of this kind. A failure is logged and the worker goes on: its first
    /// requests then pay those costs.
    pub fn warm_up_gpu(&mut self, plan: &WarmUpPlan) -> Option<WarmUpReport> {
        if matches!(self, AnyEngine::Cpu(_) | AnyEngine::CpuSharded(_)) {
            return None;
        }
        match crate::with_engine!(self, e => e.warm_up(plan)) {
            Ok(report) => {
                tracing::info!(
                    prompts = ?report.prompts,
                    decode_steps = report.decode_steps,
                    ms = format!("{:.0}", report.seconds * 1e3),
                    "warmed up (cuBLAS kernels loaded, first decode steps captured)"
                );
                Some(report)
            }
            Err(e) => {
                tracing::warn!(error = %e, "warm-up failed; the first requests pay the one-time costs");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineOptions;
    use crate::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
    use kernels::{CpuBackend, EntryDtype};

    /// A tiny checkpoint in a temporary directory (kept alive by the first value).
    fn tiny() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        write_checkpoint(&model, &InitOptions::new(Preset::Tiny, 3, WeightDtype::Bf16)).unwrap();
        (dir, model)
    }

    /// A warm-up runs its prompts (clamped to the chunk) and decode steps, leaves the
    /// pool as it found it, and a request after it gives what it gives on a fresh engine.
    #[test]
    fn warm_up_leaves_no_trace() {
        let (_dir, model) = tiny();
        let opts = EngineOptions { kv_dtype: EntryDtype::F32, max_pages: 16, max_sequences: 2, max_chunk_tokens: 64 };
        let mut warmed = Engine::load(&model, CpuBackend::new(), opts.clone()).unwrap();
        let mut fresh = Engine::load(&model, CpuBackend::new(), opts).unwrap();
        let before = warmed.pool_stats();
        let report = warmed.warm_up(&WarmUpPlan { prompts: vec![5, 300], decode_steps: 3 }).unwrap();
        assert_eq!(report.prompts, vec![5, 64], "prompts are clamped to the chunk");
        assert_eq!(warmed.pool_stats(), before, "every page and slot is back");
        let prompt: Vec<u32> = (0..40).map(|i| (i * 31 + 7) % 200).collect();
        let mut a = warmed.open_sequence().unwrap();
        let mut b = fresh.open_sequence().unwrap();
        let la = warmed.prefill(&mut a, &prompt, Logits::Last).unwrap();
        let lb = fresh.prefill(&mut b, &prompt, Logits::Last).unwrap();
        assert_eq!(la, lb, "a prefill after the warm-up gives what a fresh engine gives");
    }

    /// An engine too small for the warm-up's prompt says so and keeps nothing.
    #[test]
    fn warm_up_that_does_not_fit_fails_cleanly() {
        let (_dir, model) = tiny();
        let opts = EngineOptions { kv_dtype: EntryDtype::F32, max_pages: 1, max_sequences: 1, max_chunk_tokens: 512 };
        let mut e = Engine::load(&model, CpuBackend::new(), opts).unwrap();
        let before = e.pool_stats();
        assert!(e.warm_up(&WarmUpPlan { prompts: vec![500], decode_steps: 1 }).is_err());
        assert_eq!(e.pool_stats(), before, "the failed warm-up released its sequence");
    }
}
