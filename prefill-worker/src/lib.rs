//! The prefill worker: batches queued prompts into steps under a token budget,
//! prefills long prompts in chunks, writes each finished prompt's KV (pages, state
//! slot, last-token logits) into the decode worker's reservation over UCX, and commits
//! it there with checksums.
//!
//! With `--kvstore`, a prompt whose prefix is cached restores it (the store writes the
//! pages, and a window snapshot or a rebuild recreates the window state) and computes
//! only the rest; finished prompts offer their blocks back.
//!
//! Module map:
//! - [`config`]: flags and environment, validated once.
//! - `memory`: UCX regions handed to the engine as KV memory (the store writes there).
//! - `prefix_cache`: the kvstore client (lookup, fetch, put).
//! - `engine_loop`: the engine thread (queue, batching, restores, transfer, puts).
//! - `service`: the gRPC adapter (validation, lookup, commit on the decode worker).
//!
//! Metrics (`cluster::telemetry::PrefillMetrics`) are recorded by the engine thread and
//! served on `--metrics-listen`; trace spans continue the router's trace.

pub mod config;
mod engine_loop;
mod memory;
mod prefix_cache;
mod service;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use cluster::discovery::{EtcdConfig, Member, Registration, Role, new_member_id};
use sluice_proto::v1::prefill_server::PrefillServer;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use transfer::WireGeometry;

pub use config::PrefillConfig;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    #[error(transparent)]
    ModelConfig(#[from] model_spec::ConfigError),
    #[error(transparent)]
    Transfer(#[from] transfer::TransferError),
    #[error(transparent)]
    Discovery(#[from] cluster::discovery::DiscoveryError),
    #[error(transparent)]
    Tls(#[from] cluster::tls::TlsError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Serve gRPC on `listener` (and `/metrics` on `metrics`, when given) until `shutdown`
/// is cancelled.
pub async fn run(
    cfg: PrefillConfig,
    listener: TcpListener,
    metrics: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    cfg.validate().map_err(WorkerError::Config)?;
    let bound = listener.local_addr()?;
    let tls = cfg.tls.start(&cfg.listeners())?;
    let dialer = cluster::tls::dialer(tls.as_ref())?;
    let registry = cluster::telemetry::metrics::registry("prefill-worker");
    let recorder = cluster::telemetry::PrefillMetrics::new(&registry);
    let receiver = transfer::Receiver::start()?;
    if let Some(a) = cfg.activations {
        kernels::Activations::set_process_default(a);
    }
    let built = tokio::task::block_in_place(|| memory::build(&cfg, &receiver))?;
    recorder.set_kv_path(built.kv_path_label());
    let memory::PrefillMemory { mut engine, regions, paths, registrations } = built;
    if !cfg.no_warmup {
        tokio::task::block_in_place(|| engine.warm_up_gpu(&engine::warm_up::WarmUpPlan::default()));
    }
    let (fp, layout) = engine::with_engine!(&engine, e => (e.fingerprint.clone(), e.model.layout.clone()));
    let cache = match &cfg.kvstore {
        Some(url) => Some(
            prefix_cache::PrefixCache::new(
                url,
                &dialer,
                fp.clone(),
                layout.clone(),
                engine.config().num_layers,
                regions,
                Duration::from_millis(cfg.kvstore_timeout_ms),
            )
            .map_err(WorkerError::Config)?,
        ),
        None => None,
    };
    let geometry = WireGeometry::new(&layout, &fp, engine.config().vocab_size);
    let (vocab, max_position) = (engine.config().vocab_size, engine.config().max_position);
    let fingerprint = fp.hex();
    let loop_cfg = engine_loop::LoopConfig {
        token_budget: cfg.token_budget,
        transfer_timeout: Duration::from_millis(cfg.transfer_timeout_ms),
        keep_dumps: cfg.debug_hooks,
        transfer_delay: Duration::from_millis(cfg.debug_transfer_delay_ms),
        metrics: recorder.clone(),
        cache: cache.clone().map(|c| (c, tokio::runtime::Handle::current())),
        paths,
        put_queue_bytes: usize::try_from(cfg.kvstore_put_queue_bytes).unwrap_or(usize::MAX),
    };
    let (tx, engine_thread) = engine::with_engine!(engine, e => engine_loop::spawn(e, loop_cfg))?;
    // Scrapes keep working while the worker drains; the endpoint stops when `run` returns.
    let _metrics = cluster::telemetry::serve::spawn(metrics, registry, tls.as_ref().map(|t| t.public_http()));
    let service = service::PrefillService {
        engine: tx,
        geometry,
        vocab,
        max_position,
        debug_hooks: cfg.debug_hooks,
        decode_clients: Mutex::new(HashMap::new()),
        dialer,
        cache: cache.clone(),
        metrics: recorder,
    };

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<PrefillServer<service::PrefillService>>().await;
    let url = cluster::net::advertised_url(bound, cfg.advertise.as_deref(), tls.is_some());
    let registration = if cfg.etcd.is_empty() {
        None
    } else {
        let member = Member {
            id: new_member_id(Role::Prefill),
            role: Role::Prefill,
            grpc_addr: url.clone(),
            ucx_address: None,
            model: cfg.model_name(),
            fingerprint: fingerprint.clone(),
            capacity: serde_json::json!({"token_budget": cfg.token_budget, "sequences": cfg.max_sequences}),
        };
        let etcd = EtcdConfig::new(cfg.etcd.clone(), EtcdConfig::members_prefix(&cfg.cluster));
        Some(Registration::start(etcd, member).await?)
    };
    tracing::info!(
        %url,
        model = %cfg.model_name(),
        fingerprint = %&fingerprint[..12],
        kvstore = cfg.kvstore.as_deref().unwrap_or("none"),
        "prefill worker serving"
    );

    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(PrefillServer::new(service))
        .serve_with_incoming_shutdown(
            cluster::tls::incoming(listener, tls.as_ref().map(|t| t.internal_grpc()))?,
            shutdown.cancelled(),
        );
    // On SIGTERM: leave discovery and report NOT_SERVING first, so routers stop placing
    // work here, then let running requests finish (bounded by --drain-timeout-s).
    let on_stop = async {
        reporter.set_not_serving::<PrefillServer<service::PrefillService>>().await;
        if let Some(r) = registration {
            r.shutdown().await;
        }
    };
    let result = cluster::shutdown::drain(server, &shutdown, Duration::from_secs(cfg.drain_timeout_s), on_stop).await;
    // The server (and with it the engine's last sender) is gone: the engine thread drops
    // the engine; wait for that before the KV regions' UCX context and the process go.
    cluster::shutdown::join_thread(engine_thread, ENGINE_STOP_LIMIT, "prefill engine").await;
    // Device memory stays registered until no kvstore can be writing it any more.
    drop(registrations);
    drop(receiver);
    result.map_err(WorkerError::from)
}

/// Longest wait at shutdown for the engine thread to drop the engine (its device
/// memory, CUDA contexts, NCCL communicators).
const ENGINE_STOP_LIMIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod memory_tests;
