//! `sluice bench prefix`: the SWA policy table. For each policy, a local cluster
//! (kvstore, prefill and decode worker, router) serves prompts of a shared prefix and
//! a short unique suffix: first cold (a new prefix each time), then hits (a prefix
//! stored by a cold run, another suffix). Reported: bytes the store keeps per prefix
//! (and how much of it is window state), tokens restored and recomputed on a hit,
//! and time to first token — as the client sees it — on a hit and cold.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Args;
use cluster::launch::free_port;
use engine::EntryDtype;
use engine::config::ModelConfig;
use serde_json::{Value, json};
use sluice_proto::v1 as pb;
use sluice_proto::v1::kv_store_client::KvStoreClient;

use crate::args;
use crate::bench_cmd::bench_prompt;
use crate::local::{self, KvstoreOptions, LocalCluster, Options};

#[derive(Args)]
pub struct PrefixArgs {
    /// Model directory (default: the `small` preset, written once).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens of the shared prefix.
    #[arg(long, default_value_t = 4096)]
    prefix_tokens: usize,
    /// Tokens after it, different in every request.
    #[arg(long, default_value_t = 64)]
    suffix_tokens: usize,
    /// Policies to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "full,periodic:1024,zero")]
    policies: Vec<String>,
    /// Cold requests and hits per policy (medians are reported).
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
    /// Compute threads of each worker (default: all cores each).
    #[arg(long)]
    threads_per_worker: Option<usize>,
    /// KV entry storage of the workers and the kvstore's records: f32, bf16 or fp8.
    #[arg(long, default_value = "bf16", value_parser = args::kv_dtype)]
    kv_dtype: EntryDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

struct Row {
    policy: String,
    bytes_per_prefix: f64,
    window_bytes_per_prefix: f64,
    cached_tokens: u32,
    recomputed_tokens: f64,
    ttft_cold_ms: f64,
    ttft_hit_ms: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(a: PrefixArgs) -> Result<()> {
    ensure!(a.repeat > 0 && a.prefix_tokens >= 128, "--repeat must be at least 1 and --prefix-tokens at least 128");
    let model = match &a.model {
        Some(m) => m.clone(),
        None => local::default_model()?,
    };
    let vocab = ModelConfig::from_file(&model.join("config.json"))?.vocab_size;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut rows = Vec::new();
    for policy in &a.policies {
        eprintln!("policy {policy} ...");
        rows.push(rt.block_on(measure(&a, &model, vocab, policy))?);
    }
    if a.json {
        let out: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({"policy": r.policy, "bytes_per_prefix": r.bytes_per_prefix,
                       "window_bytes_per_prefix": r.window_bytes_per_prefix, "cached_tokens": r.cached_tokens,
                       "recomputed_tokens": r.recomputed_tokens, "ttft_cold_ms": r.ttft_cold_ms,
                       "ttft_hit_ms": r.ttft_hit_ms})
            })
            .collect();
        println!(
            "{}",
            json!({"prefix_tokens": a.prefix_tokens, "suffix_tokens": a.suffix_tokens, "kv_dtype": a.kv_dtype.name(), "rows": out})
        );
        return Ok(());
    }
    println!(
        "{} shared + {} unique prompt tokens, {} generated, KV {}; medians of {} requests",
        a.prefix_tokens,
        a.suffix_tokens,
        a.max_tokens,
        a.kv_dtype.name(),
        a.repeat
    );
    println!(
        "| policy | stored per prefix | of it window state | cached tokens on a hit | recomputed on a hit | TTFT cold | TTFT hit | cold ÷ hit |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.2} MB | {:.2} MB | {} | {:.0} | {:.0} ms | {:.0} ms | {:.1}× |",
            r.policy,
            r.bytes_per_prefix / 1e6,
            r.window_bytes_per_prefix / 1e6,
            r.cached_tokens,
            r.recomputed_tokens,
            r.ttft_cold_ms,
            r.ttft_hit_ms,
            r.ttft_cold_ms / r.ttft_hit_ms
        );
    }
    Ok(())
}

/// One request; returns (TTFT in ms, cached tokens).
async fn request(router: &str, prompt: Vec<u32>, max_tokens: u32) -> Result<(f64, u32)> {
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
        max_tokens,
        ..Default::default()
    };
    let sent = Instant::now();
    let mut first = None;
    let fin = crate::client::stream(router, req, |ev| {
        if matches!(ev.event, Some(pb::generate_event::Event::Token(_))) {
            first.get_or_insert_with(Instant::now);
        }
    })
    .await?;
    let ttft = first.context("no token came back")? - sent;
    Ok((ttft.as_secs_f64() * 1e3, fin.usage.unwrap_or_default().cached_tokens))
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

async fn measure(a: &PrefixArgs, model: &std::path::Path, vocab: usize, policy: &str) -> Result<Row> {
    let dir = tempfile::tempdir()?;
    let opts = Options {
        model: model.to_path_buf(),
        etcd: None,
        grpc: format!("127.0.0.1:{}", free_port()),
        http: format!("127.0.0.1:{}", free_port()),
        prefill: 1,
        decode: 1,
        kv_dtype: a.kv_dtype,
        threads_per_worker: a.threads_per_worker,
        log_dir: dir.path().join("logs"),
        timeout: Duration::from_secs(120),
        kvstore: Some(KvstoreOptions {
            dir: dir.path().join("kvstore"),
            policy: policy.to_string(),
            capacity: "8GiB".into(),
        }),
        extra_prefill_args: Vec::new(),
        worker_devices: Vec::new(),
        tls: None,
        gpu_direct: transfer::GpuDirect::Auto,
        activations: None,
    };
    let mut cluster = LocalCluster::start(&opts).await?;
    let result = async {
        let router = cluster.router_url.clone();
        let prompt = |prefix: u64, suffix: u64| {
            let mut p = bench_prompt(a.prefix_tokens, vocab, prefix);
            p.extend(bench_prompt(a.suffix_tokens, vocab, suffix));
            p
        };
        // Warm-up: connections, the workers' first steps.
        request(&router, prompt(999, 999), a.max_tokens).await?;
        let mut kv = KvStoreClient::connect(cluster.kvstore_url.clone().context("a kvstore")?).await?;
        let stored = |s: &pb::KvStats| {
            let p = s.stored.unwrap_or_default();
            (p.csa_main + p.csa_indexer + p.hca + p.swa, p.swa)
        };
        let before = wait_drained(&mut kv).await?;
        let mut cold = Vec::new();
        for r in 0..a.repeat as u64 {
            let (ttft, cached) = request(&router, prompt(1000 + r, 2000 + r), a.max_tokens).await?;
            ensure!(cached == 0, "a cold request found {cached} cached tokens");
            cold.push(ttft);
        }
        let after = wait_drained(&mut kv).await?;
        let (b0, w0) = stored(&before);
        let (b1, w1) = stored(&after);
        let prefill =
            cluster.procs.iter().find(|p| p.name.starts_with("prefill")).context("a prefill worker")?.name.clone();
        let label = policy.split(':').next().unwrap_or(policy);
        let series = format!(r#"sluice_prefix_cache_recompute_tokens_total{{policy="{label}"}}"#);
        let recompute_before = metric(&cluster.scrape(&prefill).await?, &series);
        let mut hit = Vec::new();
        let mut cached_tokens = 0;
        for r in 0..a.repeat as u64 {
            let (ttft, cached) = request(&router, prompt(1000 + r, 3000 + r), a.max_tokens).await?;
            ensure!(cached > 0, "a request sharing a stored prefix found nothing cached");
            cached_tokens = cached;
            hit.push(ttft);
        }
        let recompute_after = metric(&cluster.scrape(&prefill).await?, &series);
        let n = a.repeat as f64;
        Ok(Row {
            policy: policy.to_string(),
            bytes_per_prefix: (b1 - b0) as f64 / n,
            window_bytes_per_prefix: (w1 - w0) as f64 / n,
            cached_tokens,
            recomputed_tokens: (recompute_after - recompute_before) / n,
            ttft_cold_ms: median(cold),
            ttft_hit_ms: median(hit),
        })
    }
    .await;
    cluster.stop().await;
    result
}

/// Stats once the store's writer has nothing queued (bounded).
async fn wait_drained(kv: &mut KvStoreClient<tonic::transport::Channel>) -> Result<pb::KvStats> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = kv.stats(pb::KvStatsRequest {}).await?.into_inner();
        if s.queued_records == 0 {
            // The last put may still be on its way: give puts in flight a moment, then re-check.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let again = kv.stats(pb::KvStatsRequest {}).await?.into_inner();
            if again.queued_records == 0 && again.pages == s.pages {
                return Ok(again);
            }
        }
        ensure!(Instant::now() < deadline, "the kvstore did not drain: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
