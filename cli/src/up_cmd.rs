//! `sluice up`: a local cluster (router, prefill and decode workers, and a kvstore for
//! shared prefixes) as child processes on loopback ports, static discovery by default
//! or etcd with `--etcd`.
//! Waits until everything is healthy, prints how to use it (and where each service
//! serves Prometheus metrics), optionally streams a sample request, and stops everything
//! on Ctrl-C (or right after the sample with `--once`). OTEL_* variables in the
//! environment reach every service, so `OTEL_EXPORTER_OTLP_ENDPOINT=… sluice up` traces.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use cluster::launch::ServiceProcess;
use engine::EntryDtype;
use sluice_proto::v1 as pb;

use crate::{args, gpu_layout, local};

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
    /// Where the workers compute: `cpu`, `cuda` (this machine's GPUs, spread over the
    /// workers, `--gpus-per-worker` each) or `cuda:N` (every worker on GPU N).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Every worker spans these devices (e.g. `cuda:0,cuda:1`); replaces --device.
    #[arg(long)]
    devices: Option<String>,
    /// With `--device cuda`: GPUs each worker spans (expert parallelism over them).
    #[arg(long, default_value_t = 1)]
    gpus_per_worker: usize,
    /// Every prefill worker spans these devices (e.g. `cuda:0,cuda:1`), with
    /// --decode-devices for the decode workers: the two roles on disjoint GPUs.
    #[arg(long, requires = "decode_devices", conflicts_with_all = ["device", "devices"])]
    prefill_devices: Option<engine::device::DeviceList>,
    /// Every decode worker spans these devices (e.g. `cuda:2,cuda:3`); with --prefill-devices.
    #[arg(long, requires = "prefill_devices", conflicts_with_all = ["device", "devices"])]
    decode_devices: Option<engine::device::DeviceList>,
    /// Serve TLS everywhere, mutual TLS between the services: a throwaway CA and one
    /// certificate for the services are written to `tls/` in the log directory.
    #[arg(long)]
    tls: bool,
    /// GPU workers move KV in device memory (`auto`: when the loaded libucx has CUDA
    /// transports; `on`: or refuse to start; `off`: staged through host memory).
    #[arg(long, default_value = "auto")]
    gpu_direct: transfer::GpuDirect,
    /// GPU workers' activations in bf16 products: `bf16` (the reference model's
    /// precision; the default) or `split` (f32 distance from the CPU engine, slower).
    #[arg(long)]
    activations: Option<kernels::Activations>,
}

pub fn run(a: UpArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(up(a))
}

async fn up(a: UpArgs) -> Result<()> {
    let model = match &a.model {
        Some(m) => m.clone(),
        None => local::default_model()?,
    };
    let log_dir = match &a.log_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("sluice-up-{}", std::process::id())),
    };
    let tls = if a.tls { Some(throwaway_certificates(&log_dir)?) } else { None };
    let kvstore = (!a.no_kvstore).then(|| local::KvstoreOptions {
        dir: a.kvstore_dir.clone().unwrap_or_else(|| log_dir.join("kvstore")),
        policy: a.swa_policy.clone(),
        capacity: a.kvstore_capacity.clone(),
    });
    let choice = gpu_layout::DeviceChoice::from_flags(&a.device, a.devices.as_deref(), a.gpus_per_worker)
        .map_err(anyhow::Error::msg)?;
    let by_role = a.decode_devices.as_ref().map(|d| &d.0[..]).zip(a.prefill_devices.as_ref().map(|p| &p.0[..]));
    let placed = gpu_layout::assign_roles(&choice, by_role, engine::device::cuda_device_count(), a.decode, a.prefill)
        .map_err(anyhow::Error::msg)?;
    let opts = local::Options {
        model: model.clone(),
        etcd: a.etcd.clone(),
        grpc: a.grpc.clone(),
        http: a.http.clone(),
        prefill: a.prefill,
        decode: a.decode,
        kv_dtype: a.kv_dtype,
        threads_per_worker: a.threads_per_worker,
        log_dir,
        timeout: Duration::from_secs(a.ready_timeout_s),
        kvstore,
        extra_prefill_args: Vec::new(),
        worker_devices: placed.iter().map(|d| gpu_layout::flags(d)).collect(),
        tls: tls.clone(),
        gpu_direct: a.gpu_direct,
        activations: a.activations,
    };
    let mut cluster = local::LocalCluster::start(&opts).await?;
    let procs = &mut cluster.procs;
    let router_url = cluster.router_url.clone();

    let http_url = cluster.dialer.url(&a.http);
    println!("sluice is up:");
    println!("  gRPC  {router_url}   (sluice.v1.Generation)");
    println!("  HTTP  {http_url}   (POST /v1/completions, GET /v1/models, GET /health)");
    let (ca_flag, curl_ca) = match &tls {
        Some(dir) => {
            let ca = dir.join("ca.crt");
            println!("  TLS   on, mutual between services; clients trust {}", ca.display());
            (format!(" --tls-ca {}", ca.display()), format!(" --cacert {}", ca.display()))
        }
        None => (String::new(), String::new()),
    };
    println!("metrics (Prometheus):");
    for p in procs.iter() {
        if let Some(url) = &p.metrics_url {
            println!("  {:<10} {url}", p.name);
        }
    }
    println!("try:");
    println!("  sluice generate --router {router_url}{ca_flag} --prompt \"Once upon a time\" --max-tokens 32");
    println!(
        "  curl -s{curl_ca} {http_url}/v1/completions -H 'content-type: application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'"
    );

    let mut result = Ok(());
    if !a.no_sample {
        println!("\nsample request (\"The decode worker\", 24 tokens, greedy):");
        let access = crate::client::Access {
            dialer: match &tls {
                Some(dir) => cluster::tls::Dialer::tls(cluster::tls::ClientTls::trusting(&dir.join("ca.crt"), None)?),
                None => cluster::tls::Dialer::plaintext(),
            },
            api_key: None,
        };
        result = sample(&router_url, &access).await;
    }
    if !a.once && result.is_ok() {
        println!("\nCtrl-C stops the cluster.");
        result = supervise(procs).await;
    }
    eprintln!("stopping ...");
    cluster.stop().await;
    result
}

/// `sluice up --tls`: a CA and one certificate (localhost, 127.0.0.1, ::1) that every
/// service serves and presents to its peers, in `<log_dir>/tls` (as a Kubernetes secret).
fn throwaway_certificates(log_dir: &std::path::Path) -> Result<PathBuf> {
    use cluster::tls::generate::{Ca, local_names};
    let dir = log_dir.join("tls");
    let ca = Ca::new("sluice up throwaway CA")?;
    ca.issue(&local_names())?.write(&dir, &ca)?;
    Ok(dir)
}

async fn sample(router: &str, access: &crate::client::Access) -> Result<()> {
    use std::io::Write;
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("The decode worker".into())),
        max_tokens: 24,
        ..Default::default()
    };
    print!("  The decode worker");
    let fin = crate::client::stream_with(router, access, req, |ev| {
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
