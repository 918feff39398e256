//! Harness for end-to-end tests: a real cluster (router, prefill and decode worker
//! processes built from this workspace) serving the `tiny` preset on loopback ports,
//! and clients for its gRPC and HTTP APIs. Processes are killed when the cluster is
//! dropped; every wait is bounded.
//!
//! The service binaries are looked up next to the test executable (`target/<profile>`);
//! `cargo build --workspace --bins` (the README's test command does it) builds them.

pub mod deploy_files;
pub mod pytools;
pub mod reference;
use std::path::PathBuf;
use std::time::Duration;

use cluster::launch::{LaunchError, ServiceProcess, find_binary, free_port};

/// Starts of one service before a lost port race fails the test (see [`lost_bind_race`]).
const BIND_ATTEMPTS: usize = 3;

/// A port from `free_port` is released before the child binds it, and an outgoing
/// connection of any process on the machine can be given it in between (ephemeral ports
/// come from the same range). A child that exited saying so is started again elsewhere.
fn lost_bind_race(e: &LaunchError) -> bool {
    matches!(e, LaunchError::Exited { log, .. } if log.contains("Address already in use"))
}

/// The outcome of start attempt `attempt` of `what`: `true` once it is healthy, `false`
/// to start it again on fresh ports after a lost port race; any other failure (or the
/// last attempt's) fails the test.
fn started(what: &str, attempt: usize, outcome: Result<(), LaunchError>) -> bool {
    match outcome {
        Ok(()) => true,
        Err(e) if lost_bind_race(&e) && attempt < BIND_ATTEMPTS => {
            eprintln!("{what}: its port was taken before it bound it; starting it again on other ports");
            false
        }
        Err(e) => panic!("{what} healthy: {e:?}"),
    }
}
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
use http_body_util::{BodyExt, Full};
use sluice_proto::v1 as pb;
use sluice_proto::v1::decode_client::DecodeClient;
use sluice_proto::v1::generation_client::GenerationClient;
use sluice_proto::v1::kv_store_client::KvStoreClient;
use sluice_proto::v1::prefill_client::PrefillClient;
use tonic::Status;
use tonic::transport::Channel;

/// Longest a service may take to become healthy.
pub const READY: Duration = Duration::from_secs(60);

#[derive(Clone, Default)]
pub struct Spec {
    pub prefill: usize,
    pub decode: usize,
    /// etcd endpoint; static peers when `None`.
    pub etcd: Option<String>,
    /// `UCX_TLS` for the workers.
    pub ucx_tls: Option<String>,
    /// Extra arguments per prefill worker (index) and for every decode worker.
    pub prefill_args: Vec<Vec<String>>,
    pub decode_args: Vec<String>,
    pub router_args: Vec<String>,
    /// Start the workers with `--debug-hooks`.
    pub debug_hooks: bool,
    /// Extra environment for every service (e.g. `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub extra_env: Vec<(String, String)>,
    /// A kvstore for prefill workers and the router.
    pub kvstore: Option<KvSpec>,
    /// TLS: a directory with `tls.crt`, `tls.key` and `ca.crt` that every service serves
    /// and dials with (`SLUICE_TLS_DIR`); the harness's clients present the same certificate.
    pub tls: Option<PathBuf>,
}

/// Where a worker added to a running cluster runs and listens (default: this network
/// namespace, loopback, the cluster's etcd).
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// Command the worker runs under, e.g. `["ip", "netns", "exec", "NS"]`.
    pub prefix: Vec<String>,
    /// Address it listens on and is reached at, instead of 127.0.0.1.
    pub ip: Option<String>,
    /// etcd endpoint it registers with, instead of the cluster's.
    pub etcd: Option<String>,
}

/// The cluster's kvstore.
#[derive(Clone, Default)]
pub struct KvSpec {
    /// `--swa-policy`.
    pub policy: String,
    /// Extra arguments (`--capacity`, …).
    pub args: Vec<String>,
    /// Point the workers at this URL instead of starting a store (an unreachable one, say).
    pub url: Option<String>,
    /// Keep the store's files here (a filesystem of its own, say) instead of in the
    /// cluster's temporary directory.
    pub dir: Option<PathBuf>,
}

impl KvSpec {
    pub fn policy(policy: &str) -> Self {
        KvSpec { policy: policy.into(), ..Default::default() }
    }
}

impl Spec {
    pub fn new(prefill: usize, decode: usize) -> Self {
        Spec { prefill, decode, ..Default::default() }
    }
}

pub struct TestCluster {
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    pub workers: Vec<ServiceProcess>,
    pub router: Option<ServiceProcess>,
    /// Router gRPC URL.
    pub grpc: String,
    /// Router HTTP `host:port`.
    pub http: String,
    spec: Spec,
    /// Workers killed by [`TestCluster::kill_worker`].
    killed: Vec<String>,
    pub kvstore: Option<ServiceProcess>,
    /// Where workers reach the store, and where it keeps its files.
    pub kvstore_url: Option<String>,
    pub kvstore_dir: PathBuf,
    kvstore_starts: usize,
    /// How the harness dials the services (TLS when [`Spec::tls`] is set).
    pub dialer: cluster::tls::Dialer,
}

/// The `tiny` preset (seed 3), the model every test cluster serves.
pub fn write_model(dir: &std::path::Path) -> PathBuf {
    let model = dir.join("tiny");
    write_checkpoint(&model, &InitOptions::new(Preset::Tiny, 3, WeightDtype::Bf16)).expect("write model");
    model
}

impl TestCluster {
    pub async fn start(spec: Spec) -> TestCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = write_model(dir.path());
        let kvstore_dir =
            spec.kvstore.as_ref().and_then(|k| k.dir.clone()).unwrap_or_else(|| dir.path().join("kvstore"));
        let dialer = match &spec.tls {
            None => cluster::tls::Dialer::plaintext(),
            Some(d) => {
                let live = cluster::tls::Live::load(cluster::tls::Paths::in_dir(d)).expect("TLS files");
                cluster::tls::Dialer::tls(cluster::tls::ClientTls::with_identity(&live, None).expect("TLS client"))
            }
        };
        let mut c = TestCluster {
            dir,
            model,
            workers: Vec::new(),
            router: None,
            grpc: String::new(),
            http: String::new(),
            spec,
            killed: Vec::new(),
            kvstore: None,
            kvstore_url: None,
            kvstore_dir,
            kvstore_starts: 0,
            dialer,
        };
        if let Some(kv) = c.spec.kvstore.clone() {
            match kv.url {
                Some(url) => c.kvstore_url = Some(url),
                None => {
                    for attempt in 1..=BIND_ATTEMPTS {
                        c.kvstore_url = Some(c.dialer.url(&format!("127.0.0.1:{}", free_port())));
                        if started("kvstore", attempt, c.try_start_kvstore().await) {
                            break;
                        }
                    }
                }
            }
        }
        for i in 0..c.spec.decode {
            c.add_worker("decode", i, vec![]).await;
        }
        for i in 0..c.spec.prefill {
            let extra = c.spec.prefill_args.get(i).cloned().unwrap_or_default();
            c.add_worker("prefill", i, extra).await;
        }
        c.start_router().await;
        c
    }

    fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![("RUST_LOG".to_string(), "info,engine=warn".to_string())];
        if let Some(tls) = &self.spec.ucx_tls {
            env.push(("UCX_TLS".into(), tls.clone()));
        }
        if let Some(dir) = &self.spec.tls {
            env.push(("SLUICE_TLS_DIR".into(), dir.display().to_string()));
        }
        env.extend(self.spec.extra_env.iter().cloned());
        env
    }

    /// Start another worker (`role` = "prefill" | "decode"), named `<role>-<index>`,
    /// serving metrics on a port of its own ([`TestCluster::metrics_url`]).
    pub async fn add_worker(&mut self, role: &str, index: usize, extra: Vec<String>) -> String {
        self.add_worker_placed(role, index, extra, &Placement::default()).await
    }

    /// [`TestCluster::add_worker`] started and reached where `at` says (another
    /// network namespace, say).
    pub async fn add_worker_placed(&mut self, role: &str, index: usize, extra: Vec<String>, at: &Placement) -> String {
        let name = format!("{role}-{index}");
        for attempt in 1..=BIND_ATTEMPTS {
            if started(&name, attempt, self.try_add_worker(role, &name, &extra, at).await) {
                break;
            }
        }
        name
    }

    async fn try_add_worker(
        &mut self,
        role: &str,
        name: &str,
        extra: &[String],
        at: &Placement,
    ) -> Result<(), LaunchError> {
        let bin = find_binary(&format!("{role}-worker")).expect("worker binary");
        let (port, metrics_port) = (free_port(), free_port());
        let ip = at.ip.as_deref().unwrap_or("127.0.0.1");
        let mut args = vec![
            "--model".into(),
            self.model.display().to_string(),
            "--listen".into(),
            format!("{ip}:{port}"),
            "--metrics-listen".into(),
            format!("{ip}:{metrics_port}"),
        ];
        if at.ip.is_some() && self.spec.tls.is_none() {
            // Not loopback: plaintext there is an explicit choice.
            args.push("--insecure-plaintext".into());
        }
        if let Some(e) = at.etcd.as_ref().or(self.spec.etcd.as_ref()) {
            args.extend(["--etcd".into(), e.clone()]);
        }
        if self.spec.debug_hooks {
            args.push("--debug-hooks".into());
        }
        if role == "decode" {
            args.extend(self.spec.decode_args.clone());
        }
        if role == "prefill"
            && let Some(url) = &self.kvstore_url
        {
            args.extend(["--kvstore".into(), url.clone()]);
        }
        args.extend(extra.iter().cloned());
        // A prefix (e.g. `ip netns exec NS`) runs the worker through it; exec keeps its pid.
        let (program, args) = match at.prefix.split_first() {
            None => (bin, args),
            Some((first, rest)) => {
                let mut all: Vec<String> = rest.to_vec();
                all.push(bin.display().to_string());
                all.extend(args);
                (PathBuf::from(first), all)
            }
        };
        let mut p = ServiceProcess::spawn(
            name,
            &program,
            &args,
            &self.env(),
            self.dialer.url(&format!("{ip}:{port}")),
            &self.dir.path().join("logs"),
        )
        .expect("spawn worker")
        .with_dialer(self.dialer.clone())
        .with_metrics_url(self.dialer.url(&format!("{ip}:{metrics_port}/metrics")));
        p.wait_healthy(READY).await?;
        self.workers.push(p);
        Ok(())
    }

    async fn start_router(&mut self) {
        for attempt in 1..=BIND_ATTEMPTS {
            if started("router", attempt, self.try_start_router().await) {
                break;
            }
        }
        self.wait_for_workers(self.spec.prefill, self.spec.decode).await;
    }

    async fn try_start_router(&mut self) -> Result<(), LaunchError> {
        self.try_start_router_on(free_port(), free_port()).await
    }

    /// `kill -9` the router and, after `down`, start it again on the same ports (as a
    /// supervisor would), so clients find it where it was.
    pub async fn restart_router(&mut self, down: Duration) {
        let mut old = self.router.take().expect("a running router");
        old.kill().await;
        let restarts = self.workers.iter().filter(|w| w.name.starts_with("router")).count();
        old.name = format!("router-killed-{}", restarts + 1);
        self.workers.push(old); // keeps its log for failure reports
        self.killed.push(self.workers.last().expect("pushed").name.clone());
        tokio::time::sleep(down).await;
        let port = |url: &str| url.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).expect("a port");
        let (gp, hp) = (port(&self.grpc), port(&self.http));
        // The old sockets may linger a moment after the kill: a few bounded tries.
        for attempt in 1..=20 {
            match self.try_start_router_on(gp, hp).await {
                Ok(()) => return,
                Err(e) if lost_bind_race(&e) && attempt < 20 => tokio::time::sleep(Duration::from_millis(250)).await,
                Err(e) => panic!("router restart: {e:?}"),
            }
        }
    }

    async fn try_start_router_on(&mut self, gp: u16, hp: u16) -> Result<(), LaunchError> {
        let bin = find_binary("router").expect("router binary");
        let mut args = vec![
            "--model".into(),
            self.model.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{gp}"),
            "--http-listen".into(),
            format!("127.0.0.1:{hp}"),
            "--load-poll-ms".into(),
            "100".into(),
        ];
        match &self.spec.etcd {
            Some(e) => args.extend(["--etcd".into(), e.clone()]),
            None => {
                let peers: Vec<String> = self
                    .workers
                    .iter()
                    .map(|w| format!("{}={}", w.name.split('-').next().unwrap_or(""), w.grpc_url))
                    .collect();
                args.extend(["--peers".into(), peers.join(",")]);
            }
        }
        if let Some(url) = &self.kvstore_url {
            args.extend(["--kvstore".into(), url.clone()]);
        }
        args.extend(self.spec.router_args.clone());
        let url = self.dialer.url(&format!("127.0.0.1:{gp}"));
        let mut r =
            ServiceProcess::spawn("router", &bin, &args, &self.env(), url.clone(), &self.dir.path().join("logs"))
                .expect("spawn router")
                .with_dialer(self.dialer.clone())
                .with_metrics_url(self.dialer.url(&format!("127.0.0.1:{hp}/metrics")));
        r.wait_healthy(READY).await?;
        self.grpc = url;
        self.http = format!("127.0.0.1:{hp}");
        self.router = Some(r);
        Ok(())
    }

    /// Start (or start again, on the same port and directory) the cluster's kvstore.
    pub async fn start_kvstore(&mut self) {
        self.try_start_kvstore().await.expect("kvstore healthy");
    }

    async fn try_start_kvstore(&mut self) -> Result<(), LaunchError> {
        let kv = self.spec.kvstore.clone().expect("a cluster with a kvstore");
        let url = self.kvstore_url.clone().expect("a kvstore URL");
        let listen = url.trim_start_matches("http://").trim_start_matches("https://").to_string();
        let bin = find_binary("kvstore").expect("kvstore binary");
        let metrics_port = free_port();
        let mut args = vec![
            "--dir".into(),
            self.kvstore_dir.display().to_string(),
            "--listen".into(),
            listen,
            "--metrics-listen".into(),
            format!("127.0.0.1:{metrics_port}"),
            "--swa-policy".into(),
            kv.policy.clone(),
            "--staging-bytes".into(),
            "64MiB".into(),
        ];
        if !kv.args.iter().any(|a| a == "--capacity") {
            args.extend(["--capacity".into(), "256MiB".into()]);
        }
        args.extend(kv.args.clone());
        self.kvstore_starts += 1;
        let name =
            if self.kvstore_starts == 1 { "kvstore".to_string() } else { format!("kvstore-{}", self.kvstore_starts) };
        let mut p = ServiceProcess::spawn(&name, &bin, &args, &self.env(), url, &self.dir.path().join("logs"))
            .expect("spawn kvstore")
            .with_dialer(self.dialer.clone())
            .with_metrics_url(self.dialer.url(&format!("127.0.0.1:{metrics_port}/metrics")));
        p.wait_healthy(READY).await?;
        self.kvstore = Some(p);
        Ok(())
    }

    /// Stop the kvstore: `kill -9` when `crash`, else SIGTERM (it writes out its queue).
    pub async fn stop_kvstore(&mut self, crash: bool) {
        if let Some(mut p) = self.kvstore.take() {
            if crash {
                p.kill().await;
            } else {
                p.terminate(Duration::from_secs(30)).await;
            }
            self.workers.push(p); // keep its log for failure reports
            self.killed.push(self.workers.last().expect("pushed").name.clone());
        }
    }

    pub async fn kvstore_client(&self) -> KvStoreClient<Channel> {
        KvStoreClient::new(
            self.dialer.channel(self.kvstore_url.as_deref().expect("a kvstore")).await.expect("connect kvstore"),
        )
    }

    pub async fn kvstore_stats(&self) -> pb::KvStats {
        self.kvstore_client().await.stats(pb::KvStatsRequest {}).await.expect("kvstore stats").into_inner()
    }

    /// Wait (bounded) until the store holds at least `pages` pages and `snapshots`
    /// snapshots, all on disk.
    pub async fn wait_kvstore(&self, pages: u64, snapshots: u64) -> pb::KvStats {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.kvstore_stats().await;
            if s.pages >= pages && s.snapshots >= snapshots && s.queued_records == 0 {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the kvstore never held {pages} pages and {snapshots} snapshots: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the router sees at least this many healthy workers of each role.
    pub async fn wait_for_workers(&self, prefill: usize, decode: usize) {
        let deadline = std::time::Instant::now() + READY;
        loop {
            if let Ok((200, body)) = self.http_get("/health").await {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                if v["prefill_workers"].as_u64().unwrap_or(0) >= prefill as u64
                    && v["decode_workers"].as_u64().unwrap_or(0) >= decode as u64
                {
                    return;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "router never saw {prefill} prefill + {decode} decode workers"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn worker(&mut self, name: &str) -> &mut ServiceProcess {
        self.workers.iter_mut().find(|w| w.name == name).unwrap_or_else(|| panic!("no worker {name}"))
    }

    /// `kill -9` a worker, as a crash would; later page checks skip it.
    pub async fn kill_worker(&mut self, name: &str) {
        self.worker(name).kill().await;
        self.killed.push(name.to_string());
    }

    /// Where a service (`router`, or a worker's name) serves Prometheus metrics.
    pub fn metrics_url(&self, name: &str) -> String {
        self.workers
            .iter()
            .chain(self.router.iter())
            .chain(self.kvstore.iter())
            .find(|w| w.name == name)
            .and_then(|w| w.metrics_url.clone())
            .unwrap_or_else(|| panic!("no metrics endpoint for {name}"))
    }

    /// The text exposition a service serves at `/metrics` (bounded wait).
    pub async fn scrape(&self, name: &str) -> String {
        let url = self.metrics_url(name);
        let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://")).expect("an http(s) URL");
        let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (status, body) =
            http_with(&self.dialer, addr, "GET", path, None, &[]).await.unwrap_or_else(|e| panic!("scrape {url}: {e}"));
        assert_eq!(status, 200, "scrape {url}: {body}");
        body
    }

    pub fn worker_url(&self, name: &str) -> String {
        self.workers.iter().find(|w| w.name == name).unwrap_or_else(|| panic!("no worker {name}")).grpc_url.clone()
    }

    pub async fn client(&self) -> GenerationClient<Channel> {
        GenerationClient::new(self.dialer.channel(&self.grpc).await.expect("connect router"))
    }

    pub async fn decode_client(&self, name: &str) -> DecodeClient<Channel> {
        DecodeClient::new(self.dialer.channel(&self.worker_url(name)).await.expect("connect decode worker"))
    }

    pub async fn prefill_client(&self, name: &str) -> PrefillClient<Channel> {
        PrefillClient::new(self.dialer.channel(&self.worker_url(name)).await.expect("connect prefill worker"))
    }

    /// Run a request to completion (bounded), returning its tokens and final event.
    pub async fn generate(&self, req: pb::GenerateRequest) -> Result<Generated, Status> {
        let fut = async {
            let mut stream = self.client().await.generate(req).await?.into_inner();
            let mut tokens = Vec::new();
            while let Some(ev) = stream.message().await? {
                match ev.event {
                    Some(pb::generate_event::Event::Token(t)) => tokens.push(t),
                    Some(pb::generate_event::Event::Final(f)) => return Ok(Generated { tokens, fin: f }),
                    None => {}
                }
            }
            Err(Status::unknown("stream ended without a final event"))
        };
        tokio::time::timeout(Duration::from_secs(60), fut)
            .await
            .unwrap_or_else(|_| Err(Status::deadline_exceeded("test timeout")))
    }

    pub async fn decode_load(&self, name: &str) -> pb::DecodeLoad {
        self.decode_client(name).await.load(pb::LoadRequest {}).await.expect("load").into_inner()
    }

    /// Every `ERROR` line in the logs of every service this cluster started (its own and
    /// UCX's, which both spell the level as a word of its own), as `(service, line)`.
    pub fn error_lines(&self) -> Vec<(String, String)> {
        let mut found = Vec::new();
        for p in self.workers.iter().chain(self.router.iter()).chain(self.kvstore.iter()) {
            let text = std::fs::read_to_string(&p.log).unwrap_or_else(|e| panic!("{}: {e}", p.log.display()));
            for line in text.lines().filter(|l| l.split_whitespace().any(|w| w == "ERROR")) {
                found.push((p.name.clone(), line.to_string()));
            }
        }
        found
    }

    /// The live decode worker that is running (or queueing) a request: the one to kill to
    /// interrupt a stream (bounded wait; fails when none or several are busy).
    pub async fn busy_decode_worker(&self) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mut busy = Vec::new();
            for w in self.workers.iter().filter(|w| w.name.starts_with("decode") && !self.killed.contains(&w.name)) {
                let l = self.decode_load(&w.name).await;
                if l.running + l.waiting > 0 {
                    busy.push(w.name.clone());
                }
            }
            match busy.len() {
                1 => return busy.remove(0),
                0 => assert!(std::time::Instant::now() < deadline, "no decode worker is running a request"),
                _ => panic!("several decode workers are busy: {busy:?}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Poll until every page and slot of every live decode worker is free again (bounded).
    pub async fn assert_pages_return(&self, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        for w in self.workers.iter().filter(|w| w.name.starts_with("decode") && !self.killed.contains(&w.name)) {
            loop {
                let l = self.decode_load(&w.name).await;
                if l.free_pages == l.total_pages && l.running == 0 && l.waiting == 0 {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "{}: pages not returned: {l:?}", w.name);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    pub async fn http_get(&self, path: &str) -> Result<(u16, String), String> {
        http_with(&self.dialer, &self.http, "GET", path, None, &[]).await
    }

    pub async fn http_post(&self, path: &str, body: &str) -> Result<(u16, String), String> {
        http_with(&self.dialer, &self.http, "POST", path, Some(body), &[]).await
    }
}

#[derive(Debug)]
pub struct Generated {
    pub tokens: Vec<pb::TokenEvent>,
    pub fin: pb::FinalEvent,
}

impl Generated {
    pub fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.token_id).collect()
    }
    pub fn logprobs(&self) -> Vec<f32> {
        self.tokens.iter().map(|t| t.logprob).collect()
    }
}

/// One HTTP/1.1 request with a bounded wait; returns status and body.
pub async fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), String> {
    http_with(&cluster::tls::Dialer::plaintext(), addr, method, path, body, &[]).await
}

/// [`http`] over TLS when `dialer` does TLS, with extra `headers`.
pub async fn http_with(
    dialer: &cluster::tls::Dialer,
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Result<(u16, String), String> {
    let Some(tls) = dialer.client_tls() else { return http_plain(addr, method, path, body, headers).await };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| format!("{addr}: expected host:port"))?;
    let port: u16 = port.parse().map_err(|_| format!("{addr}: bad port"))?;
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(bytes::Bytes::from(body.unwrap_or("").to_string()))).map_err(|e| e.to_string())?;
    let fut = async {
        let stream = tls.connect(host, port, true).await.map_err(|e| e.to_string())?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    };
    tokio::time::timeout(Duration::from_secs(60), fut).await.map_err(|_| "HTTPS request timed out".to_string())?
}

async fn http_plain(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Result<(u16, String), String> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    let req = headers
        .iter()
        .fold(req, |r, (k, v)| r.header(*k, *v))
        .body(Full::new(bytes::Bytes::from(body.unwrap_or("").to_string())))
        .map_err(|e| e.to_string())?;
    let fut = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    };
    tokio::time::timeout(Duration::from_secs(60), fut).await.map_err(|_| "HTTP request timed out".to_string())?
}

/// A greedy token-id request.
pub fn ids_request(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
        max_tokens,
        sampling: Some(pb::SamplingParams { logprobs: true, ..Default::default() }),
        ..Default::default()
    }
}

/// A deterministic prompt of `len` ids below `vocab`.
pub fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503)) >> 9) % (vocab - 2) + 2)
        .collect()
}

impl Drop for TestCluster {
    /// A failing test prints the tail of every service's log, so CI output says why.
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in self.workers.iter().chain(self.router.iter()).chain(self.kvstore.iter()) {
                eprintln!("----- {} log (tail) -----\n{}", p.name, p.log_tail(40));
            }
        }
    }
}
