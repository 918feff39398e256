//! `sluice up`: a local cluster (router, prefill and decode workers, and a kvstore for
//! shared prefixes) as child processes on loopback ports, static discovery by default
//! or etcd with `--etcd`.
//! Waits until everything is healthy, prints how to use it (and where each service
//! serves Prometheus metrics), optionally streams a sample request, and stops everything
//! on Ctrl-C (or right after the sample with `--once`). OTEL_* variables in the
//! environment reach every service, so `OTEL_EXPORTER_OTLP_ENDPOINT=… sluice up` traces.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use cluster::launch::{ServiceProcess, find_binary, free_port};
use engine::EntryDtype;
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
use sluice_proto::v1 as pb;

use crate::args;

#[derive(Args)]
pub struct UpArgs {
    /// Model directory to serve; without it the `small` preset (seed 0) is written to
    /// target/models/small once and served.
    #[arg(long)]
    model: Option<PathBuf>,
    /// etcd endpoint(s) for discovery instead of a static peer list.
    #[arg(long)]
    etcd: Option<String>,
    /// Router gRPC address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    grpc: String,
    /// Router HTTP (OpenAI-style) address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: String,
    /// Prefill workers to start.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode workers to start.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// KV entry storage of the workers.
    #[arg(long, default_value = "bf16", value_parser = args::kv_dtype)]
    kv_dtype: EntryDtype,
    /// Compute threads per worker (default: all cores each).
    #[arg(long)]
    threads_per_worker: Option<usize>,
    /// Where the services write their logs (default: a new temporary directory).
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Do not send the sample request once the cluster is up.
    #[arg(long)]
    no_sample: bool,
    /// Stop the cluster after the sample request (a smoke test).
    #[arg(long)]
    once: bool,
    /// Longest wait for the services to become healthy (seconds).
    #[arg(long, default_value_t = 120)]
    ready_timeout_s: u64,
    /// Run without the shared-prefix kvstore (every prompt computed from scratch).
    #[arg(long)]
    no_kvstore: bool,
    /// The kvstore's SWA policy: full, periodic:P or zero.
    #[arg(long, default_value = "periodic:1024")]
    swa_policy: String,
    /// Where the kvstore keeps its files (default: `kvstore/` in the log directory).
    #[arg(long)]
    kvstore_dir: Option<PathBuf>,
    /// Disk the kvstore may use.
    #[arg(long, default_value = "4GiB")]
    kvstore_capacity: String,
}

fn default_model() -> Result<PathBuf> {
    let dir = PathBuf::from("target/models/small");
    if !dir.join("config.json").exists() {
        eprintln!("writing the small preset model to {} (once) ...", dir.display());
        write_checkpoint(&dir, &InitOptions { preset: Preset::Small, seed: 0, dtype: WeightDtype::Bf16 })?;
    }
    Ok(dir)
}

pub fn run(a: UpArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(up(a))
}

async fn up(a: UpArgs) -> Result<()> {
    if a.prefill == 0 || a.decode == 0 {
        bail!("a cluster needs at least one prefill and one decode worker");
    }
    let model = match &a.model {
        Some(m) => m.clone(),
        None => default_model()?,
    };
    let model_arg = model.canonicalize().with_context(|| format!("model directory {}", model.display()))?;
    let model_arg = model_arg.display().to_string();
    let log_dir = match &a.log_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("sluice-up-{}", std::process::id())),
    };
    let bins = (find_binary("router")?, find_binary("prefill-worker")?, find_binary("decode-worker")?);
    let timeout = Duration::from_secs(a.ready_timeout_s);
    let mut common = vec!["--model".to_string(), model_arg.clone(), "--kv-dtype".into(), a.kv_dtype.name().into()];
    if let Some(t) = a.threads_per_worker {
        common.extend(["--threads".into(), t.to_string()]);
    }
    if let Some(e) = &a.etcd {
        common.extend(["--etcd".into(), e.clone()]);
    }
    // Children inherit the rest of the environment (OTEL_*, SLUICE_LOG_FORMAT, UCX_*).
    let env = vec![("RUST_LOG".to_string(), std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))];

    let mut procs: Vec<ServiceProcess> = Vec::new();
    let mut peers = Vec::new();
    // The kvstore first: prefill workers and the router are pointed at it.
    let kvstore_url = if a.no_kvstore {
        None
    } else {
        let (port, metrics_port) = (free_port(), free_port());
        let dir = a.kvstore_dir.clone().unwrap_or_else(|| log_dir.join("kvstore"));
        let args: Vec<String> = vec![
            "--dir".into(),
            dir.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--metrics-listen".into(),
            format!("127.0.0.1:{metrics_port}"),
            "--swa-policy".into(),
            a.swa_policy.clone(),
            "--capacity".into(),
            a.kvstore_capacity.clone(),
            "--staging-bytes".into(),
            "256MiB".into(),
        ];
        let url = format!("http://127.0.0.1:{port}");
        let mut p = ServiceProcess::spawn("kvstore", &find_binary("kvstore")?, &args, &env, url.clone(), &log_dir)?
            .with_metrics_url(format!("http://127.0.0.1:{metrics_port}/metrics"));
        eprintln!("starting the kvstore ({}, {}) in {} ...", a.swa_policy, a.kvstore_capacity, dir.display());
        p.wait_healthy(timeout).await?;
        procs.push(p);
        Some(url)
    };
    let roles =
        std::iter::repeat_n(("decode", &bins.2), a.decode).chain(std::iter::repeat_n(("prefill", &bins.1), a.prefill));
    for (i, (role, bin)) in roles.enumerate() {
        let (port, metrics_port) = (free_port(), free_port());
        let mut args = common.clone();
        if role == "prefill"
            && let Some(url) = &kvstore_url
        {
            args.extend(["--kvstore".into(), url.clone()]);
        }
        args.extend(["--listen".into(), format!("127.0.0.1:{port}")]);
        args.extend(["--metrics-listen".into(), format!("127.0.0.1:{metrics_port}")]);
        let url = format!("http://127.0.0.1:{port}");
        peers.push(format!("{role}={url}"));
        let p = ServiceProcess::spawn(&format!("{role}-{i}"), bin, &args, &env, url, &log_dir)?;
        procs.push(p.with_metrics_url(format!("http://127.0.0.1:{metrics_port}/metrics")));
    }
    eprintln!(
        "starting {} prefill and {} decode worker(s) on {} (logs in {}) ...",
        a.prefill,
        a.decode,
        model.display(),
        log_dir.display()
    );
    for p in procs.iter_mut().filter(|p| p.name != "kvstore") {
        p.wait_healthy(timeout).await?;
    }
    let mut router_args = vec![
        "--model".to_string(),
        model_arg,
        "--listen".into(),
        a.grpc.clone(),
        "--http-listen".into(),
        a.http.clone(),
    ];
    match &a.etcd {
        Some(e) => router_args.extend(["--etcd".into(), e.clone()]),
        None => router_args.extend(["--peers".into(), peers.join(",")]),
    }
    if let Some(url) = &kvstore_url {
        router_args.extend(["--kvstore".into(), url.clone()]);
    }
    let router_url = format!("http://{}", a.grpc);
    let mut router = ServiceProcess::spawn("router", &bins.0, &router_args, &env, router_url.clone(), &log_dir)?
        .with_metrics_url(format!("http://{}/metrics", a.http));
    router.wait_healthy(timeout).await?;
    wait_for_workers(&a.http, timeout).await?;
    procs.push(router);

    println!("sluice is up:");
    println!("  gRPC  {router_url}   (sluice.v1.Generation)");
    println!("  HTTP  http://{}   (POST /v1/completions, GET /v1/models, GET /health)", a.http);
    println!("metrics (Prometheus):");
    for p in &procs {
        if let Some(url) = &p.metrics_url {
            println!("  {:<10} {url}", p.name);
        }
    }
    println!("try:");
    println!("  sluice generate --router {router_url} --prompt \"Once upon a time\" --max-tokens 32");
    println!(
        "  curl -s http://{}/v1/completions -H 'content-type: application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'",
        a.http
    );

    let mut result = Ok(());
    if !a.no_sample {
        println!("\nsample request (\"The decode worker\", 24 tokens, greedy):");
        result = sample(&router_url).await;
    }
    if !a.once && result.is_ok() {
        println!("\nCtrl-C stops the cluster.");
        result = supervise(&mut procs).await;
    }
    eprintln!("stopping ...");
    for p in procs.iter_mut().rev() {
        p.terminate(Duration::from_secs(5)).await;
    }
    result
}

/// Wait until the router's HTTP health says it reaches prefill and decode workers.
async fn wait_for_workers(http: &str, timeout: Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Ok(body) = http_get(http, "/health").await
            && body.contains("\"status\":\"ok\"")
        {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("the router did not see healthy workers within {}s", timeout.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A minimal HTTP/1.1 GET (the health check needs nothing more).
async fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr)).await??;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out)).await??;
    Ok(out)
}

async fn sample(router: &str) -> Result<()> {
    use std::io::Write;
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("The decode worker".into())),
        max_tokens: 24,
        ..Default::default()
    };
    print!("  The decode worker");
    let fin = crate::client::stream(router, req, |ev| {
        if let Some(pb::generate_event::Event::Token(t)) = &ev.event {
            print!("{}", t.text_delta.escape_debug());
            let _ = std::io::stdout().flush();
        }
    })
    .await?;
    let (u, t) = (fin.usage.unwrap_or_default(), fin.timings.unwrap_or_default());
    println!(
        "\n  [{} prompt ({} cached) + {} generated tokens; time to first token {:.1} ms (prefill {:.1} ms, KV transfer {:.2} ms), total {:.1} ms]",
        u.prompt_tokens,
        u.cached_tokens,
        u.completion_tokens,
        t.time_to_first_token_ms,
        t.prefill_ms,
        t.kv_transfer_ms,
        t.total_ms
    );
    Ok(())
}

/// Run until Ctrl-C/SIGTERM, or until a service dies (an error).
async fn supervise(procs: &mut [ServiceProcess]) -> Result<()> {
    let stop = cluster::shutdown::on_signals();
    loop {
        for p in procs.iter_mut() {
            if let Some(status) = p.exited() {
                bail!("{} exited ({status}); last log lines:\n{}", p.name, p.log_tail(20));
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}
