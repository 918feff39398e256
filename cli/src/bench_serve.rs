//! `sluice bench serve`: a load generator for a running cluster, in the manner of vLLM's
//! `benchmark_serving.py` and SGLang's `bench_serving`. It streams
//! `sluice.v1.Generation/Generate` requests of a generated workload (token ids, from a
//! seed) to a router at a request rate (Poisson arrivals, or all at once), for each rate
//! of a sweep in turn, and reports per rate: completions and failures (by gRPC status),
//! request and token throughput (also per GPU), TTFT, inter-token latency, TPOT and
//! end-to-end latency percentiles, and the prefix-cache hit rate from the router's usage.
//! docs/serving-bench.md describes the workloads and the metrics.
//!
//! Modules: `workload` (requests and arrival times, pure), `stats` (per-request records
//! and the summary, pure), `driver` (sending and timing, async), `report` (table, JSON).

mod driver;
mod report;
mod stats;
mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use report::RateRun;
use workload::{Rate, Rng, Shape};

/// Salts of the streams that are not the prompts, so each is independent of the others.
const ARRIVAL_SALT: u64 = 0xa441_7a15;
const WARMUP_SALT: u64 = 0x3a2b_0c0d;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// vLLM's `random` dataset: lengths uniform around --input-len / --output-len.
    Random,
    /// SGLang's `generated-shared-prefix`: --groups × --prompts-per-group prompts, each a
    /// group's --system-len prefix and its own --question-len question.
    SharedPrefix,
}

#[derive(Args)]
pub struct ServeArgs {
    /// Router gRPC address (https://… for a router serving TLS, with --tls-ca).
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    router: String,
    /// CA certificate (PEM) that signed the router's certificate: talk TLS to it.
    #[arg(long, env = "SLUICE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// API key for a router started with --api-keys-file (sent as `authorization: Bearer`).
    #[arg(long, env = "SLUICE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[arg(long, value_enum, default_value_t = Workload::Random)]
    workload: Workload,
    /// random: requests per rate.
    #[arg(long, default_value_t = 200)]
    num_prompts: usize,
    /// random: mean prompt length (tokens).
    #[arg(long, default_value_t = 1024)]
    input_len: usize,
    /// Tokens generated per request (random: the mean; shared-prefix: every request).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// random: lengths are uniform in [len·(1−r), len·(1+r)], r in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    range_ratio: f64,
    /// shared-prefix: groups (distinct system prompts).
    #[arg(long, default_value_t = 64)]
    groups: usize,
    /// shared-prefix: prompts per group (requests per rate = groups × this).
    #[arg(long, default_value_t = 16)]
    prompts_per_group: usize,
    /// shared-prefix: tokens of each group's system prompt (the shared prefix).
    #[arg(long, default_value_t = 2048)]
    system_len: usize,
    /// shared-prefix: tokens of each prompt's own question after the prefix.
    #[arg(long, default_value_t = 128)]
    question_len: usize,
    /// Vocabulary size: token ids are drawn from 0..V.
    #[arg(long, required_unless_present = "model")]
    vocab: Option<usize>,
    /// Model directory whose config.json gives the vocabulary size (instead of --vocab).
    #[arg(long, conflicts_with = "vocab")]
    model: Option<PathBuf>,
    /// Seed of the workload and the arrival times (rate i of a sweep uses seed + i, so a
    /// later rate does not hit prefixes an earlier one stored).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Requests per second (Poisson arrivals), or `inf` to send every request at once.
    #[arg(long, default_value = "inf", conflicts_with = "request_rates")]
    request_rate: Rate,
    /// A sweep: each rate in turn, e.g. 1,2,4,inf.
    #[arg(long, value_delimiter = ',')]
    request_rates: Option<Vec<Rate>>,
    /// Most requests in flight; later arrivals wait for a slot (their clock starts when sent).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Sampling temperature of every request; 0 (the default) is greedy, as the serving
    /// benchmarks run. Drawing requests are sampled on the decode workers' hosts, so
    /// this measures that cost too; each carries its own seed (--seed + its index).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus mass of drawing requests, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Draw among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// GPUs the cluster uses (for output tokens/s per GPU).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Longest a request may take from send to its final event; past it, it is cancelled
    /// and counted as failed (CLIENT_TIMEOUT).
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Requests sent (and awaited) before the first rate, of fresh tokens, not measured.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Write the full results (config, per-rate summary, every request) to this file;
    /// rewritten after each rate, so a sweep cut short keeps the rates it finished.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Free text stored in the JSON (e.g. which cluster this was).
    #[arg(long)]
    label: Option<String>,
}

impl ServeArgs {
    fn shape(&self) -> Shape {
        match self.workload {
            Workload::Random => Shape::Random {
                num_prompts: self.num_prompts,
                input_len: self.input_len,
                output_len: self.output_len,
                range_ratio: self.range_ratio,
            },
            Workload::SharedPrefix => Shape::SharedPrefix {
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                system_len: self.system_len,
                question_len: self.question_len,
                output_len: self.output_len,
            },
        }
    }

    fn config_json(&self, vocab: usize, rates: &[Rate]) -> serde_json::Value {
        let workload = match self.shape() {
            Shape::Random { num_prompts, input_len, output_len, range_ratio } => json!({"name": "random",
                "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio}),
            Shape::SharedPrefix { groups, prompts_per_group, system_len, question_len, output_len } => json!({
                "name": "shared-prefix", "groups": groups, "prompts_per_group": prompts_per_group,
                "system_len": system_len, "question_len": question_len, "output_len": output_len}),
        };
        json!({
            "router": self.router, "label": self.label, "workload": workload, "vocab": vocab, "seed": self.seed,
            "request_rates": rates.iter().map(Rate::to_string).collect::<Vec<_>>(),
            "max_concurrency": self.max_concurrency, "gpus": self.gpus, "timeout_s": self.timeout_s,
            "warmup": self.warmup,
            "sampling": {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k},
        })
    }

    fn sampling(&self) -> driver::Sampling {
        driver::Sampling { temperature: self.temperature, top_p: self.top_p, top_k: self.top_k, seed: self.seed }
    }
}

pub fn run(a: ServeArgs) -> Result<()> {
    let shape = a.shape();
    shape.validate().map_err(anyhow::Error::msg)?;
    if a.gpus == 0 || a.timeout_s == 0 || a.max_concurrency == Some(0) {
        bail!("--gpus, --timeout-s and --max-concurrency must be at least 1");
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!("--temperature must be 0 (greedy) or more, got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must lie in (0, 1], got {}", a.top_p);
    }
    let vocab = match (&a.model, a.vocab) {
        (_, Some(v)) if v > 0 => v,
        (_, Some(_)) => bail!("--vocab must be at least 1"),
        (Some(dir), None) => {
            let path = dir.join("config.json");
            engine::config::ModelConfig::from_file(&path)
                .with_context(|| format!("reading {}", path.display()))?
                .vocab_size
        }
        (None, None) => bail!("give --vocab or --model"),
    };
    let rates = a.request_rates.clone().unwrap_or_else(|| vec![a.request_rate]);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(sweep(&a, &shape, vocab, &rates))
}

async fn sweep(a: &ServeArgs, shape: &Shape, vocab: usize, rates: &[Rate]) -> Result<()> {
    let access = crate::client::Access::new(&a.router, a.tls_ca.as_deref(), a.api_key.clone())?;
    let first = shape.generate(a.seed, vocab);
    let per_rate = first.len();
    let in_flight = a.max_concurrency.unwrap_or(per_rate).min(per_rate);
    let timeout = Duration::from_secs(a.timeout_s);
    let target = Arc::new(driver::Target::connect(&a.router, &access, in_flight, timeout, a.sampling()).await?);
    let sampling = if a.temperature > 0.0 {
        format!("temperature {}, top-p {}, top-k {}", a.temperature, a.top_p, a.top_k)
    } else {
        "greedy".to_string()
    };
    eprintln!(
        "{} workload, {per_rate} requests per rate, vocabulary {vocab}, seed {}, {sampling}; rates {}; router {}",
        shape.name(),
        a.seed,
        rates.iter().map(Rate::to_string).collect::<Vec<_>>().join(","),
        a.router
    );

    // Warm-up: fresh tokens (no prefix of the workload gets stored), the first
    // request's length; a cluster that cannot serve one request stops the run here.
    let mut warm = Rng::new(a.seed ^ WARMUP_SALT);
    let first_len = first[0].prompt.len();
    for i in 0..a.warmup {
        let req = workload::Request {
            prompt: warm.tokens(first_len, vocab),
            output_len: (a.output_len as u32).clamp(1, 16),
            group: None,
        };
        if let stats::Outcome::Failed { code, message } = target.send(i, format!("bench-warmup-{i}"), &req).await {
            bail!("the warm-up request failed: {code}: {message}");
        }
    }

    let mut runs: Vec<RateRun> = Vec::new();
    for (i, &rate) in rates.iter().enumerate() {
        let seed = a.seed.wrapping_add(i as u64);
        let requests = shape.generate(seed, vocab);
        let arrivals = workload::arrivals(requests.len(), rate, &mut Rng::new(seed ^ ARRIVAL_SALT));
        let bar = progress(requests.len() as u64, &format!("rate {rate}"));
        if bar.is_hidden() {
            eprintln!("rate {rate}: sending {} requests ...", requests.len());
        }
        let (records, duration) =
            driver::run(target.clone(), &format!("r{i}"), requests, &arrivals, a.max_concurrency, &bar).await?;
        bar.finish_and_clear();
        let summary = stats::summarize(&records, duration, a.gpus);
        eprintln!(
            "rate {rate}: {} ok, {} failed in {:.1} s; {:.1} output tok/s; TTFT p50 {:.1} ms; ITL p50 {:.1} ms; prefix hit rate {:.1}%",
            summary.completed,
            summary.failed,
            duration,
            summary.output_throughput,
            summary.ttft.p50,
            summary.itl.p50,
            summary.hit_rate * 100.0
        );
        runs.push(RateRun { rate, seed, summary, records });
        if let Some(path) = &a.json {
            let doc = report::document(a.config_json(vocab, rates), &runs);
            std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }

    print!("{}", report::table(&runs));
    println!("\nTime to first token, by the servers' own timings (means, ms):\n");
    print!("{}", report::ttft_breakdown(&runs));
    let problems = report::problems(&runs);
    if !problems.is_empty() {
        eprint!("{problems}");
    }
    if runs.iter().all(|r| r.summary.completed == 0) {
        bail!("no request completed");
    }
    Ok(())
}

/// A bar of requests done, on a terminal; hidden otherwise (each rate prints a line).
fn progress(n: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr_with_hz(4));
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:32}] {pos}/{len} requests, {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}
