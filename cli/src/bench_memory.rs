//! What `sluice bench engine --device cuda:N` asks of the GPUs, and the memory plan's
//! verdict on it before anything is loaded: the KV pool sized for the largest context
//! × batch the run decodes, the workspace of its prefill chunk, the weights of the model
//! directory (checkpoint headers, else its config) spread over the GPUs. A run that
//! cannot fit is refused with what to change, instead of loading for minutes and then
//! failing to allocate its pool (V4-Flash on two 80 GB H100s loaded 156 GB, then stopped
//! at the KV allocation).

use std::path::Path;

use engine::EntryDtype;
use engine::config::ModelConfig;
use engine::memory_plan::{Devices, MemoryPlan, Residence, StepShape};

/// The engine sizes of one benchmark run (what `Engine::load` is given).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchSizes {
    /// KV pages of the whole pool (all GPUs).
    pub max_pages: usize,
    /// Sequences open at once (all GPUs).
    pub max_sequences: usize,
    /// Rows of the largest forward step (the prefill chunk).
    pub chunk_rows: usize,
    /// Longest context a row attends over.
    pub context: usize,
}

impl BenchSizes {
    /// Sizes for decode steps at up to `max_ctx` tokens of context and `max_batch`
    /// sequences (plus the prefill's and a spare), `decode_steps` tokens each, a prefill of
    /// `prefill_tokens` in chunks of `chunk_tokens`, over `ranks` GPUs (each GPU's share of
    /// the pools holds whole shares of the sequences).
    pub fn new(
        max_ctx: usize,
        max_batch: usize,
        prefill_tokens: usize,
        chunk_tokens: usize,
        decode_steps: usize,
        ranks: usize,
    ) -> BenchSizes {
        let ranks = ranks.max(1);
        let pages_per_seq = (max_ctx.max(prefill_tokens) + decode_steps + 2).div_ceil(128) + 1;
        let seqs = (max_batch + 2).div_ceil(ranks) * ranks;
        BenchSizes {
            max_pages: pages_per_seq * seqs,
            max_sequences: seqs,
            chunk_rows: prefill_tokens.min(chunk_tokens).max(1),
            context: max_ctx.max(prefill_tokens),
        }
    }

    /// The memory plan of these sizes for `cfg` (weights of `dir`) on `ranks` GPUs of
    /// `device_bytes` each.
    pub fn plan(
        &self,
        dir: &Path,
        cfg: &ModelConfig,
        ranks: usize,
        device_bytes: u64,
        kv_dtype: EntryDtype,
    ) -> Result<MemoryPlan, String> {
        let ranks = ranks.max(1);
        let on = Devices { residence: Residence::Gpu, count: ranks, bytes: device_bytes };
        let shape = StepShape { rows: self.chunk_rows, context: self.context, sequences: self.max_sequences / ranks };
        MemoryPlan::for_dir(dir, cfg, on, kv_dtype, shape).map_err(|e| e.to_string())
    }

    /// Whether the run fits the plan; the error says what to change on this command line.
    pub fn check(&self, plan: &MemoryPlan, devices: &str) -> Result<(), String> {
        let ranks = plan.devices.max(1);
        let per_gpu = self.max_pages / ranks;
        if plan.pages_that_fit() >= per_gpu as u64 {
            return Ok(());
        }
        let gb = |b: u64| b as f64 / 1e9;
        let mut msg = format!(
            "this run does not fit {devices}: weights {:.1} GB + workspace {:.1} GB + reserve {:.1} GB a GPU, and \
             a KV pool of {per_gpu} pages a GPU ({:.1} GB) for {} sequences of up to {} tokens, exceed {:.1} GB a GPU.",
            gb(plan.weights.total()),
            gb(plan.workspace),
            gb(plan.reserve),
            gb(per_gpu as u64 * plan.page_bytes),
            self.max_sequences,
            self.context,
            gb(plan.device_bytes),
        );
        if plan.page_room() > 0 {
            msg.push_str(" Lower --contexts or --batches (the pool is sized for the largest of each)");
        } else {
            msg.push_str(" Not even the weights and workspace fit: lower --chunk-tokens or --prefill-tokens");
        }
        if plan.kv_dtype != EntryDtype::Fp8 {
            msg.push_str(", use --kv-dtype fp8");
        }
        msg.push_str(
            ", run on more GPUs (--devices), or benchmark a smaller model (sluice model init --layers); \
             --skip-memory-check runs it anyway.",
        );
        Err(msg)
    }
}

/// The plan of a run on GPUs `ordinals` (their smallest memory), made before loading and
/// printed, with the GPUs' label for [`BenchSizes::check`].
#[cfg(feature = "cuda")]
pub fn plan_run(
    dir: &Path,
    ordinals: &[usize],
    kv_dtype: EntryDtype,
    sizes: &BenchSizes,
) -> anyhow::Result<(MemoryPlan, String)> {
    use anyhow::Context;
    let path = dir.join("config.json");
    let cfg = ModelConfig::from_file(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut bytes = u64::MAX;
    for &o in ordinals {
        bytes = bytes.min(engine::device::memory_bytes(engine::device::Device::Cuda(o))?);
    }
    let plan = sizes.plan(dir, &cfg, ordinals.len(), bytes, kv_dtype).map_err(anyhow::Error::msg)?;
    let label = ordinals.iter().map(|o| format!("cuda:{o}")).collect::<Vec<_>>().join(",");
    eprintln!("{label}: {}", plan.summary());
    Ok((plan, label))
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::config::parse_hf;
    use engine::init::Preset;
    use engine::memory_plan::H200_BYTES;

    const H100_BYTES: u64 = 81_559 << 20;

    fn flash() -> ModelConfig {
        parse_hf(&Preset::Flash.config_json()).unwrap()
    }

    /// The run docs/perf.md makes of all of V4-Flash: fp8 KV, 8K prefill and contexts,
    /// batches up to 64.
    fn flash_run(ranks: usize) -> BenchSizes {
        BenchSizes::new(8192, 64, 8192, 8192, 8, ranks)
    }

    #[test]
    fn sizes_cover_the_largest_context_and_batch_in_whole_shares() {
        let s = BenchSizes::new(8192, 64, 8192, 4096, 16, 2);
        // (8192 + 16 + 2) / 128 rounded up, plus one, for 66 sequences.
        assert_eq!(s, BenchSizes { max_pages: 66 * 66, max_sequences: 66, chunk_rows: 4096, context: 8192 });
        assert_eq!(BenchSizes::new(1024, 1, 8192, 8192, 8, 1).context, 8192);
        assert_eq!(BenchSizes::new(8192, 3, 512, 8192, 8, 4).max_sequences, 8);
    }

    #[test]
    fn flash_fits_two_h200s_not_one_and_not_two_h100s() {
        let dir = Path::new("/nonexistent");
        let plan = |ranks, bytes| flash_run(ranks).plan(dir, &flash(), ranks, bytes, EntryDtype::Fp8).unwrap();
        flash_run(2).check(&plan(2, H200_BYTES), "cuda:0,cuda:1").unwrap();
        let err = flash_run(1).check(&plan(1, H200_BYTES), "cuda:0").unwrap_err();
        assert!(err.contains("Not even the weights") && err.contains("more GPUs"), "{err}");
        let err = flash_run(2).check(&plan(2, H100_BYTES), "cuda:0,cuda:1").unwrap_err();
        assert!(err.contains("does not fit cuda:0,cuda:1") && err.contains("--skip-memory-check"), "{err}");
    }

    #[test]
    fn a_pool_too_large_names_the_flags_that_shrink_it() {
        let cfg = parse_hf(&Preset::Flash.full_config(Some(20)).unwrap()).unwrap();
        let dir = Path::new("/nonexistent");
        let small = BenchSizes::new(8192, 8, 8192, 8192, 8, 1);
        let plan = small.plan(dir, &cfg, 1, H200_BYTES, EntryDtype::Bf16).unwrap();
        small.check(&plan, "cuda:0").unwrap();
        // A million tokens of context for 256 sequences cannot fit beside the weights.
        let huge = BenchSizes::new(1 << 20, 256, 8192, 8192, 8, 1);
        let plan = huge.plan(dir, &cfg, 1, H200_BYTES, EntryDtype::Bf16).unwrap();
        let err = huge.check(&plan, "cuda:0").unwrap_err();
        assert!(err.contains("Lower --contexts or --batches") && err.contains("--kv-dtype fp8"), "{err}");
    }
}
