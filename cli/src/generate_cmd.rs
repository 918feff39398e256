//! `sluice generate`: generate from a prompt, either with a model loaded in this
//! process (`--model`) or through a running cluster's router (`--router`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use engine::generate::{GenerateRequest, generate};
use engine::sampling::SamplingParams;
use engine::{AnyEngine, Device, EngineOptions, EntryDtype};
use serde_json::json;

use crate::args::{self, TokenIds};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory (config.json + safetensors) to run in this process.
    #[arg(long, required_unless_present = "router", conflicts_with = "router")]
    model: Option<PathBuf>,
    /// Router gRPC address of a running cluster, e.g. http://127.0.0.1:50051 (https://…
    /// for a router serving TLS, with --tls-ca).
    #[arg(long)]
    router: Option<String>,
    /// CA certificate (PEM) that signed the router's certificate: talk TLS to it.
    #[arg(long, env = "SLUICE_TLS_CA", requires = "router")]
    tls_ca: Option<PathBuf>,
    /// API key for a router started with --api-keys-file (sent as `authorization: Bearer`).
    #[arg(long, env = "SLUICE_API_KEY", requires = "router", hide_env_values = true)]
    api_key: Option<String>,
    /// Prompt text (tokenised with the model's tokenizer.json).
    #[arg(long, required_unless_present = "prompt_ids", conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_parser = args::token_ids)]
    prompt_ids: Option<TokenIds>,
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
    /// Compute device for --model: cpu, or cuda:N (a GPU of this machine).
    #[arg(long, default_value = "cpu", value_parser = args::device, conflicts_with = "router")]
    device: Device,
    /// Several devices for --model, e.g. `cuda:0,cuda:1` (experts split over them);
    /// replaces --device.
    #[arg(long, conflicts_with_all = ["router", "device"])]
    devices: Option<engine::device::DeviceList>,
    /// On GPUs, the activations' precision in bf16 products: bf16 (the reference
    /// model's; the default) or split (f32 distance from the CPU engine).
    #[arg(long, conflicts_with = "router")]
    activations: Option<kernels::Activations>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(router) = a.router.clone() {
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        return rt.block_on(through_router(&router, a));
    }
    let model = a.model.clone().expect("clap requires --model without --router");
    let prompt_ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.0.clone(),
        (None, Some(text)) => {
            let codec = model_spec_text(&model)?;
            codec.encode(text)?
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        top_logprobs: a.top_logprobs,
    };
    sampling.validate()?;
    let devices = engine::device::chosen(a.device, a.devices.as_ref());
    // The sequence lives on one device; the pools split evenly, so each gets its room.
    let n = devices.len();
    let needed_pages = (prompt_ids.len() + a.max_tokens).div_ceil(128) + 1;
    let opts =
        EngineOptions { kv_dtype: a.kv_dtype, max_pages: needed_pages * n, max_sequences: n, ..Default::default() };
    let label = engine::device::devices_label(&devices);
    if let Some(act) = a.activations {
        kernels::Activations::set_process_default(act);
    }
    let mut engine = AnyEngine::load_on(&model, &devices, opts)
        .with_context(|| format!("loading model from {} on {label}", model.display()))?;
    let req = GenerateRequest {
        prompt: prompt_ids,
        max_tokens: a.max_tokens,
        sampling,
        stop_tokens: a.stop_ids.map(|s| s.0).unwrap_or_default(),
    };
    let mut out = std::io::stdout().lock();
    if !a.json {
        writeln!(out, "{:>6}  {:>8}  {:>10}  top alternatives", "step", "token", "logprob")?;
    }
    let mut step = 0;
    let generation = engine::with_engine!(&mut engine, e => generate(e, &req, |s| {
        if !a.json {
            let alts: Vec<String> = s.top.iter().map(|(t, lp)| format!("{t}:{lp:.4}")).collect();
            let _ = writeln!(out, "{step:>6}  {:>8}  {:>10.5}  {}", s.token, s.logprob, alts.join(" "));
            let _ = out.flush();
        }
        step += 1;
    }))?;
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

fn model_spec_text(dir: &std::path::Path) -> Result<model_spec::text::TextCodec> {
    model_spec::text::TextCodec::load(dir)?
        .ok_or_else(|| anyhow::anyhow!("{} has no tokenizer.json; use --prompt-ids", dir.display()))
}

/// Stream from a running cluster, printing text as it arrives.
async fn through_router(router: &str, a: GenerateArgs) -> Result<()> {
    use sluice_proto::v1 as pb;
    let prompt = match (a.prompt_ids, a.prompt) {
        (Some(ids), _) => pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.0 }),
        (None, Some(text)) => pb::generate_request::Prompt::Text(text),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let req = pb::GenerateRequest {
        prompt: Some(prompt),
        max_tokens: a.max_tokens as u32,
        sampling: Some(pb::SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k as u32,
            seed: Some(a.seed),
            logprobs: true,
            top_logprobs: a.top_logprobs as u32,
        }),
        stop: a.stop_ids.map(|s| pb::StopCriteria { token_ids: s.0, strings: vec![] }),
        ..Default::default()
    };
    let mut tokens = Vec::new();
    let json = a.json;
    let access = crate::client::Access::new(router, a.tls_ca.as_deref(), a.api_key.clone())?;
    let fin = crate::client::stream_with(router, &access, req, |ev| {
        if let Some(pb::generate_event::Event::Token(t)) = &ev.event {
            if !json {
                print!("{}", t.text_delta);
                let _ = std::io::stdout().flush();
            }
            tokens.push(t.clone());
        }
    })
    .await?;
    let (u, t) = (fin.usage.unwrap_or_default(), fin.timings.unwrap_or_default());
    let finish = if fin.finish_reason == pb::FinishReason::Stop as i32 { "stop" } else { "length" };
    if json {
        let v = json!({
            "tokens": tokens.iter().map(|t| t.token_id).collect::<Vec<_>>(),
            "logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "text": tokens.iter().map(|t| t.text_delta.as_str()).collect::<String>(),
            "finish_reason": finish,
            "usage": {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens},
            "timings": {"queue_ms": t.queue_ms, "prefix_restore_ms": t.prefix_restore_ms, "prefill_ms": t.prefill_ms,
                        "kv_transfer_ms": t.kv_transfer_ms, "time_to_first_token_ms": t.time_to_first_token_ms,
                        "total_ms": t.total_ms},
        });
        println!("{v}");
    } else {
        println!(
            "\n[finish: {finish}; {} prompt + {} generated tokens; time to first token {:.1} ms, total {:.1} ms]",
            u.prompt_tokens, u.completion_tokens, t.time_to_first_token_ms, t.total_ms
        );
    }
    Ok(())
}
