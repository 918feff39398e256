//! `sluice model init` and `sluice model inspect`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use engine::EntryDtype;
use engine::config::ModelConfig;
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};

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
    /// Model shape: tiny (tests) or small (~70M parameters, the local cluster's default).
    #[arg(long, default_value = "small", value_parser = |s: &str| Preset::parse(s).ok_or(format!("unknown preset `{s}`; use tiny or small")))]
    preset: Preset,
    /// Seed of the random weights; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory to create (must not already hold a checkpoint).
    #[arg(long)]
    out: PathBuf,
    /// Weight storage: bf16, f32, or fp8 (FP8 projections + FP4 experts, as DeepSeek ships V4).
    #[arg(long, default_value = "bf16", value_parser = |s: &str| WeightDtype::parse(s).ok_or(format!("unknown dtype `{s}`; use bf16, f32 or fp8")))]
    dtype: WeightDtype,
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
}

pub fn run(cmd: ModelCmd) -> Result<()> {
    match cmd {
        ModelCmd::Init(a) => {
            let started = std::time::Instant::now();
            eprintln!("writing {} preset (seed {}) to {} ...", a.preset.name(), a.seed, a.out.display());
            let cfg = write_checkpoint(&a.out, &InitOptions { preset: a.preset, seed: a.seed, dtype: a.dtype })?;
            let size = std::fs::metadata(a.out.join("model.safetensors")).map(|m| m.len()).unwrap_or(0);
            println!(
                "wrote {} ({} layers, hidden {}, vocab {}; {:.1} MB) in {:.1}s",
                a.out.display(),
                cfg.num_layers,
                cfg.hidden_size,
                cfg.vocab_size,
                size as f64 / 1e6,
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
        ModelCmd::Inspect(a) => {
            let path = if a.model.is_dir() { a.model.join("config.json") } else { a.model.clone() };
            let cfg = ModelConfig::from_file(&path).with_context(|| format!("reading {}", path.display()))?;
            let r = engine::inspect::report(&cfg, a.kv_dtype);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r.json)?);
            } else {
                print!("{}", r.text);
            }
            Ok(())
        }
    }
}
