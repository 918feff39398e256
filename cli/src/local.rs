//! A local cluster of child processes on loopback ports — kvstore (optional), decode
//! and prefill workers, router — started in dependency order, each waited for until
//! healthy (bounded). `sluice up` runs one for people; `sluice bench prefix` runs one
//! per SWA policy.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use cluster::launch::{ServiceProcess, find_binary, free_port};
use cluster::tls::{ClientTls, Dialer};
use engine::EntryDtype;
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};

/// The `small` preset (seed 0), written to target/models/small once: what `sluice up`
/// serves and the benchmarks measure when no model is given.
pub fn default_model() -> Result<PathBuf> {
    let dir = PathBuf::from("target/models/small");
    if !dir.join("config.json").exists() {
        eprintln!("writing the small preset model to {} (once) ...", dir.display());
        write_checkpoint(&dir, &InitOptions::new(Preset::Small, 0, WeightDtype::Bf16))?;
    }
    Ok(dir)
}

#[derive(Clone, Debug)]
pub struct KvstoreOptions {
    pub dir: PathBuf,
    pub policy: String,
    pub capacity: String,
}

#[derive(Clone, Debug)]
pub struct Options {
    pub model: PathBuf,
    pub etcd: Option<String>,
    /// Router listen addresses (`host:port`).
    pub grpc: String,
    pub http: String,
    pub prefill: usize,
    pub decode: usize,
    pub kv_dtype: EntryDtype,
    pub threads_per_worker: Option<usize>,
    pub log_dir: PathBuf,
    /// Longest wait for each service to become healthy.
    pub timeout: Duration,
    pub kvstore: Option<KvstoreOptions>,
    pub extra_prefill_args: Vec<String>,
    /// Device flags of each worker in start order (decode workers first, then prefill
    /// workers); empty: all on the CPU.
    pub worker_devices: Vec<Vec<String>>,
    /// TLS: a directory with `tls.crt`, `tls.key` and `ca.crt` every service uses.
    pub tls: Option<PathBuf>,
    /// `--gpu-direct` of every worker.
    pub gpu_direct: transfer::GpuDirect,
    /// `--activations` of every worker (None: theirs by default, bf16).
    pub activations: Option<kernels::Activations>,
}

pub struct LocalCluster {
    /// Every process, in start order (the router last).
    pub procs: Vec<ServiceProcess>,
    pub router_url: String,
    pub kvstore_url: Option<String>,
    /// How the services are dialed (TLS with the services' certificate, when on).
    pub dialer: Dialer,
}

impl LocalCluster {
    pub async fn start(o: &Options) -> Result<LocalCluster> {
        if o.prefill == 0 || o.decode == 0 {
            bail!("a cluster needs at least one prefill and one decode worker");
        }
        let model_arg = o.model.canonicalize().with_context(|| format!("model directory {}", o.model.display()))?;
        let model_arg = model_arg.display().to_string();
        let bins = (find_binary("router")?, find_binary("prefill-worker")?, find_binary("decode-worker")?);
        let mut common = vec!["--model".to_string(), model_arg.clone(), "--kv-dtype".into(), o.kv_dtype.name().into()];
        common.extend(["--gpu-direct".into(), o.gpu_direct.to_string()]);
        if let Some(a) = o.activations {
            common.extend(["--activations".into(), a.to_string()]);
        }
        if let Some(t) = o.threads_per_worker {
            common.extend(["--threads".into(), t.to_string()]);
        }
        if let Some(e) = &o.etcd {
            common.extend(["--etcd".into(), e.clone()]);
        }
        // Children inherit the rest of the environment (OTEL_*, SLUICE_LOG_FORMAT, UCX_*).
        let mut env = vec![("RUST_LOG".to_string(), std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))];
        // Everything runs on this host: KV moves through shared memory unless the caller
        // chose transports (left alone, UCX may carry large puts over loopback TCP).
        // GPU workers add the CUDA transports when the loaded libucx has them, so their KV
        // moves GPU to GPU (Debian's libucx has none: naming them would only make UCX
        // warn, and KV is staged through host memory as always).
        if std::env::var_os("UCX_TLS").is_none() {
            let on_gpus = o.worker_devices.iter().flatten().any(|a| a.contains("cuda"));
            let cuda_ucx = on_gpus && transfer::Receiver::start().is_ok_and(|rx| rx.supports_cuda());
            env.push(("UCX_TLS".into(), if cuda_ucx { "shm,cuda_ipc,cuda_copy" } else { "shm" }.into()));
        }
        let dialer = match &o.tls {
            None => Dialer::plaintext(),
            Some(dir) => {
                env.push(("SLUICE_TLS_DIR".into(), dir.display().to_string()));
                let live = cluster::tls::Live::load(cluster::tls::Paths::in_dir(dir))?;
                Dialer::tls(ClientTls::with_identity(&live, None)?)
            }
        };
        let url = |addr: String| dialer.url(&addr);
        let mut procs: Vec<ServiceProcess> = Vec::new();

        // The kvstore first: prefill workers and the router are pointed at it.
        let kvstore_url = match &o.kvstore {
            None => None,
            Some(kv) => {
                let (port, metrics_port) = (free_port(), free_port());
                let args: Vec<String> = vec![
                    "--dir".into(),
                    kv.dir.display().to_string(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}"),
                    "--metrics-listen".into(),
                    format!("127.0.0.1:{metrics_port}"),
                    "--swa-policy".into(),
                    kv.policy.clone(),
                    "--capacity".into(),
                    kv.capacity.clone(),
                    "--staging-bytes".into(),
                    "256MiB".into(),
                ];
                let url = url(format!("127.0.0.1:{port}"));
                let mut p =
                    ServiceProcess::spawn("kvstore", &find_binary("kvstore")?, &args, &env, url.clone(), &o.log_dir)?
                        .with_dialer(dialer.clone())
                        .with_metrics_url(format!("{}/metrics", dialer.url(&format!("127.0.0.1:{metrics_port}"))));
                eprintln!("starting the kvstore ({}, {}) in {} ...", kv.policy, kv.capacity, kv.dir.display());
                p.wait_healthy(o.timeout).await?;
                procs.push(p);
                Some(url)
            }
        };

        let mut peers = Vec::new();
        let roles = std::iter::repeat_n(("decode", &bins.2), o.decode)
            .chain(std::iter::repeat_n(("prefill", &bins.1), o.prefill));
        for (i, (role, bin)) in roles.enumerate() {
            let (port, metrics_port) = (free_port(), free_port());
            let mut args = common.clone();
            args.extend(o.worker_devices.get(i).into_iter().flatten().cloned());
            if role == "prefill" {
                if let Some(url) = &kvstore_url {
                    args.extend(["--kvstore".into(), url.clone()]);
                }
                args.extend(o.extra_prefill_args.iter().cloned());
            }
            args.extend(["--listen".into(), format!("127.0.0.1:{port}")]);
            args.extend(["--metrics-listen".into(), format!("127.0.0.1:{metrics_port}")]);
            let url = url(format!("127.0.0.1:{port}"));
            peers.push(format!("{role}={url}"));
            let p = ServiceProcess::spawn(&format!("{role}-{i}"), bin, &args, &env, url, &o.log_dir)?;
            let metrics = format!("{}/metrics", dialer.url(&format!("127.0.0.1:{metrics_port}")));
            procs.push(p.with_dialer(dialer.clone()).with_metrics_url(metrics));
        }
        eprintln!(
            "starting {} prefill and {} decode worker(s) on {} (logs in {}) ...",
            o.prefill,
            o.decode,
            o.model.display(),
            o.log_dir.display()
        );
        for p in procs.iter_mut().filter(|p| p.name != "kvstore") {
            p.wait_healthy(o.timeout).await?;
        }
        let mut router_args = vec![
            "--model".to_string(),
            model_arg,
            "--listen".into(),
            o.grpc.clone(),
            "--http-listen".into(),
            o.http.clone(),
        ];
        match &o.etcd {
            Some(e) => router_args.extend(["--etcd".into(), e.clone()]),
            None => router_args.extend(["--peers".into(), peers.join(",")]),
        }
        if let Some(url) = &kvstore_url {
            router_args.extend(["--kvstore".into(), url.clone()]);
        }
        let router_url = dialer.url(&o.grpc);
        let mut router = ServiceProcess::spawn("router", &bins.0, &router_args, &env, router_url.clone(), &o.log_dir)?
            .with_dialer(dialer.clone())
            .with_metrics_url(format!("{}/metrics", dialer.url(&o.http)));
        router.wait_healthy(o.timeout).await?;
        wait_for_workers(&o.http, dialer.client_tls(), o.timeout).await?;
        procs.push(router);
        Ok(LocalCluster { procs, router_url, kvstore_url, dialer })
    }

    /// Stop every process, the router first (SIGTERM, then SIGKILL after a grace).
    pub async fn stop(&mut self) {
        for p in self.procs.iter_mut().rev() {
            p.terminate(Duration::from_secs(5)).await;
        }
    }

    /// A service's `/metrics` text.
    pub async fn scrape(&self, name: &str) -> Result<String> {
        let p = self.procs.iter().find(|p| p.name == name).with_context(|| format!("no service {name}"))?;
        let url = p.metrics_url.as_deref().with_context(|| format!("{name} serves no metrics"))?;
        let rest = url.trim_start_matches("http://").trim_start_matches("https://");
        let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let body = http_get(addr, path, self.dialer.client_tls()).await?;
        Ok(body.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or(body))
    }
}

/// Wait until the router's HTTP health says it reaches prefill and decode workers.
async fn wait_for_workers(http: &str, tls: Option<&ClientTls>, timeout: Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Ok(body) = http_get(http, "/health", tls).await
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

/// A minimal HTTP/1.1 GET (health and metrics need nothing more), over TLS with `tls`.
async fn http_get(addr: &str, path: &str, tls: Option<&ClientTls>) -> std::io::Result<String> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let connect = Duration::from_secs(1);
    match tls {
        None => exchange(tokio::time::timeout(connect, tokio::net::TcpStream::connect(addr)).await??, &request).await,
        Some(tls) => {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "443"));
            let port = port.parse().map_err(|_| std::io::Error::other(format!("{addr}: bad port")))?;
            exchange(tokio::time::timeout(connect, tls.connect(host, port, true)).await??, &request).await
        }
    }
}

async fn exchange(
    mut s: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    request: &str,
) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(request.as_bytes()).await?;
    let mut out = String::new();
    // A TLS peer may close without close_notify after `Connection: close`; what was read counts.
    match tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await? {
        Ok(_) => Ok(out),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !out.is_empty() => Ok(out),
        Err(e) => Err(e),
    }
}
