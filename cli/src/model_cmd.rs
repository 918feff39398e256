//! `sluice model init` and `sluice model inspect`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use engine::EntryDtype;
use engine::config::ModelConfig;
use engine::init::{InitOptions, Preset, WeightDtype, planned_bytes, write_checkpoint_with};

use crate::args;

#[derive(Subcommand)]
pub enum ModelCmd {
    /// Write a deterministic random checkpoint (official DeepSeek layout).
    Init(InitArgs),
    /// Print a model's layer table and KV bytes per token per pool.
    Inspect(InspectArgs),
}

#[derive(Args)]
pub struct InitArgs {
    /// Model shape: tiny (tests), small (~70M parameters, the local cluster's default),
    /// flash-bench (V4-Flash attention widths, 4 layers, small MoE), flash or pro (the
    /// released V4-Flash / V4-Pro configs, sharded, FP8 + FP4 experts as shipped).
    #[arg(long, default_value = "small", value_parser = |s: &str| Preset::parse(s).ok_or(format!("unknown preset `{s}`; use tiny, small, flash-bench, flash or pro")))]
    preset: Preset,
    /// flash / pro only: keep the first N layers (real widths, the real layer pattern).
    #[arg(long)]
    layers: Option<usize>,
    /// Seed of the random weights; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory to create (must not already hold a checkpoint).
    #[arg(long)]
    out: PathBuf,
    /// Weight storage: bf16, f32, or fp8 (FP8 projections + FP4 experts, as DeepSeek ships
    /// V4). Default: bf16 for the small presets, fp8 (the only choice) for flash and pro.
    #[arg(long, value_parser = |s: &str| WeightDtype::parse(s).ok_or(format!("unknown dtype `{s}`; use bf16, f32 or fp8")))]
    dtype: Option<WeightDtype>,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Model directory (with config.json), or a config.json file.
    model: PathBuf,
    /// Entry dtype to size the KV pools for.
    #[arg(long, default_value = "bf16", value_parser = args::kv_dtype)]
    kv_dtype: EntryDtype,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also print the memory plan for this device kind: `cuda` (an H200 unless
    /// --gpu-memory says otherwise) or `cpu` (weights dequantised, host memory).
    #[arg(long, value_parser = ["cpu", "cuda"])]
    device: Option<String>,
    /// Memory of one device for the plan (e.g. 141GB, 80GiB). Default: an H200 (143,771 MiB).
    #[arg(long, value_parser = engine::memory_plan::parse_size)]
    gpu_memory: Option<u64>,
    /// GPUs one worker spans (routed experts split across them; the rest replicated).
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Rows of one step (decode batch, or prefill token budget).
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Longest context a row attends over.
    #[arg(long, default_value_t = 65536)]
    context: usize,
    /// Running sequences (state slots).
    #[arg(long)]
    sequences: Option<usize>,
}

pub fn run(cmd: ModelCmd) -> Result<()> {
    match cmd {
        ModelCmd::Init(a) => {
            let started = std::time::Instant::now();
            let default = if a.preset.is_full_size() { WeightDtype::Fp8 } else { WeightDtype::Bf16 };
            let opts =
                InitOptions { layers: a.layers, ..InitOptions::new(a.preset, a.seed, a.dtype.unwrap_or(default)) };
            let layers = a.layers.map(|n| format!(", first {n} layers")).unwrap_or_default();
            eprintln!("writing {} preset (seed {}{layers}) to {} ...", a.preset.name(), a.seed, a.out.display());
            let done = std::sync::atomic::AtomicU64::new(0);
            let cfg = crate::progress::while_counting("writing", planned_bytes(&opts), &done, || {
                write_checkpoint_with(&a.out, &opts, &done)
            })?;
            let bytes = done.load(std::sync::atomic::Ordering::Relaxed);
            let secs = started.elapsed().as_secs_f64();
            println!(
                "wrote {} ({} layers, hidden {}, vocab {}; {:.2} GB of tensors) in {secs:.1}s ({:.2} GB/s)",
                a.out.display(),
                cfg.num_layers,
                cfg.hidden_size,
                cfg.vocab_size,
                bytes as f64 / 1e9,
                bytes as f64 / 1e9 / secs.max(1e-9)
            );
            Ok(())
        }
        ModelCmd::Inspect(a) => {
            let path = if a.model.is_dir() { a.model.join("config.json") } else { a.model.clone() };
            let cfg = ModelConfig::from_file(&path).with_context(|| format!("reading {}", path.display()))?;
            let r = engine::inspect::report(&cfg, a.kv_dtype);
            let plan = match a.device.as_deref() {
                None => None,
                Some(kind) => {
                    use engine::memory_plan::{Devices, H200_BYTES, MemoryPlan, Residence, StepShape};
                    if a.devices == 0 {
                        anyhow::bail!("--devices must be at least 1");
                    }
                    let (residence, default) = match kind {
                        "cuda" => (Residence::Gpu, H200_BYTES),
                        _ => (Residence::Cpu, engine::device::memory_bytes(engine::device::Device::Cpu)?),
                    };
                    let shape = StepShape {
                        rows: a.max_batch,
                        context: a.context,
                        sequences: a.sequences.unwrap_or(a.max_batch),
                    };
                    let dir = if a.model.is_dir() { a.model.clone() } else { a.model.with_file_name("") };
                    let bytes = a.gpu_memory.unwrap_or(default);
                    let on = Devices { residence, count: a.devices, bytes };
                    Some(MemoryPlan::for_dir(&dir, &cfg, on, a.kv_dtype, shape)?)
                }
            };
            if a.json {
                let mut v = r.json;
                if let Some(p) = &plan {
                    v["memory_plan"] = p.json();
                }
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", r.text);
                if let Some(p) = &plan {
                    print!("\n{}", p.text());
                }
            }
            Ok(())
        }
    }
}
