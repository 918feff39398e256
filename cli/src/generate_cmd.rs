//! `sluice generate`: load a model in this process and generate from token ids.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use engine::generate::{GenerateRequest, generate};
use engine::sampling::SamplingParams;
use engine::{CpuBackend, Engine, EngineOptions, EntryDtype};
use serde_json::json;

use crate::args::{self, TokenIds};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_parser = args::token_ids)]
    prompt_ids: TokenIds,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Sampling temperature; 0 (default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sample only among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Alternatives (with logprobs) to print per token.
    #[arg(long, default_value_t = 0)]
    top_logprobs: usize,
    /// Token ids that end generation (comma-separated).
    #[arg(long, value_parser = args::token_ids)]
    stop_ids: Option<TokenIds>,
    /// KV entry storage: f32 (conformance) or bf16.
    #[arg(long, default_value = "f32", value_parser = args::kv_dtype)]
    kv_dtype: EntryDtype,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        top_logprobs: a.top_logprobs,
    };
    sampling.validate()?;
    let needed_pages = (a.prompt_ids.0.len() + a.max_tokens).div_ceil(128) + 1;
    let opts = EngineOptions { kv_dtype: a.kv_dtype, max_pages: needed_pages, max_sequences: 1, ..Default::default() };
    let mut engine = Engine::load(&a.model, CpuBackend::new(), opts)
        .with_context(|| format!("loading model from {}", a.model.display()))?;
    let req = GenerateRequest {
        prompt: a.prompt_ids.0.clone(),
        max_tokens: a.max_tokens,
        sampling,
        stop_tokens: a.stop_ids.map(|s| s.0).unwrap_or_default(),
    };
    let mut out = std::io::stdout().lock();
    if !a.json {
        writeln!(out, "{:>6}  {:>8}  {:>10}  top alternatives", "step", "token", "logprob")?;
    }
    let mut step = 0;
    let generation = generate(&mut engine, &req, |s| {
        if !a.json {
            let alts: Vec<String> = s.top.iter().map(|(t, lp)| format!("{t}:{lp:.4}")).collect();
            let _ = writeln!(out, "{step:>6}  {:>8}  {:>10.5}  {}", s.token, s.logprob, alts.join(" "));
            let _ = out.flush();
        }
        step += 1;
    })?;
    if a.json {
        let v = json!({
            "tokens": generation.tokens.iter().map(|s| s.token).collect::<Vec<_>>(),
            "logprobs": generation.tokens.iter().map(|s| s.logprob).collect::<Vec<_>>(),
            "top_logprobs": generation.tokens.iter().map(|s| s.top.iter().map(|(t, lp)| json!({"token": t, "logprob": lp})).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "finish_reason": generation.finish.name(),
            "usage": {"prompt_tokens": req.prompt.len(), "completion_tokens": generation.tokens.len()},
            "timings": {"prefill_ms": generation.prefill_time.as_secs_f64() * 1e3, "decode_ms": generation.decode_time.as_secs_f64() * 1e3},
        });
        writeln!(out, "{v}")?;
    } else {
        writeln!(
            out,
            "finish: {}; prompt {} tokens in {:.1} ms, {} generated in {:.1} ms",
            generation.finish.name(),
            req.prompt.len(),
            generation.prefill_time.as_secs_f64() * 1e3,
            generation.tokens.len(),
            generation.decode_time.as_secs_f64() * 1e3
        )?;
    }
    Ok(())
}
