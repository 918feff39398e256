//! The decode worker: owns a page pool registered with UCX, reserves pages for
//! requests (the KV handshake), verifies what prefill workers write into them, and
//! decodes committed requests with continuous batching, streaming each token.
//!
//! Module map:
//! - [`config`]: flags and environment, validated once.
//! - `memory`: UCX regions handed to the engine as KV memory.
//! - `reservations`: reservation lifecycle and leases (pure logic).
//! - `constraint`: grammars that mask sampling (llguidance), per request.
//! - `engine_loop`: the engine thread (commands, batching, sampling).
//! - `service`: the gRPC adapter.
//!
//! Metrics (`cluster::telemetry::DecodeMetrics`) are recorded by the engine thread and
//! served on `--metrics-listen`; trace spans continue their callers' traces.

pub mod config;
mod constraint;
mod engine_loop;
mod memory;
mod reservations;
mod service;

use std::time::Duration;

use base64::Engine as _;
use cluster::discovery::{EtcdConfig, Member, Registration, Role, new_member_id};
use sluice_proto::v1::decode_server::DecodeServer;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::DecodeConfig;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    ModelConfig(#[from] model_spec::ConfigError),
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
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
    cfg: DecodeConfig,
    listener: TcpListener,
    metrics: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    cfg.validate().map_err(WorkerError::Config)?;
    let bound = listener.local_addr()?;
    let tls = cfg.tls.start(&cfg.listeners())?;
    let registry = cluster::telemetry::metrics::registry("decode-worker");
    let recorder = cluster::telemetry::DecodeMetrics::new(&registry);
    let receiver = transfer::Receiver::start()?;
    if let Some(a) = cfg.activations {
        kernels::Activations::set_process_default(a);
    }
    let memory::DecodeMemory { mut engine, template, registrations } = {
        let cfg = cfg.clone();
        // Loading weights is blocking work.
        tokio::task::block_in_place(|| memory::build(&cfg, &receiver))?
    };
    if !cfg.no_warmup {
        tokio::task::block_in_place(|| engine.warm_up_gpu(&engine::warm_up::WarmUpPlan::default()));
    }
    recorder.set_kv_path(engine::with_engine!(&engine, e => e.kv_memory_path()));
    let max_position = engine.config().max_position;
    let fingerprint = engine::with_engine!(&engine, e => e.fingerprint.hex());
    let lease = Duration::from_millis(cfg.lease_ms);
    let loop_cfg = engine_loop::LoopConfig {
        max_batch: cfg.max_batch,
        lease,
        step_delay: Duration::from_millis(cfg.debug_step_delay_ms),
        metrics: recorder,
        // A tokenizer llguidance cannot read only costs structured output, not serving.
        grammars: match constraint::Grammars::load(&cfg.model, engine.config().vocab_size) {
            Ok(g) => g.map(std::sync::Arc::new),
            Err(e) => {
                tracing::warn!(error = %e, "constrained decoding is off");
                None
            }
        },
    };
    let (tx, engine_thread) = engine::with_engine!(engine, e => engine_loop::spawn(e, loop_cfg))?;
    // Scrapes keep working while the worker drains; the endpoint stops when `run` returns.
    let _metrics = cluster::telemetry::serve::spawn(metrics, registry, tls.as_ref().map(|t| t.public_http()));
    let service = service::DecodeService {
        engine: tx,
        template: template.clone(),
        lease,
        debug_hooks: cfg.debug_hooks,
        max_position,
    };

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<DecodeServer<service::DecodeService>>().await;
    let url = cluster::net::advertised_url(bound, cfg.advertise.as_deref(), tls.is_some());
    let registration = if cfg.etcd.is_empty() {
        None
    } else {
        let member = Member {
            id: new_member_id(Role::Decode),
            role: Role::Decode,
            grpc_addr: url.clone(),
            ucx_address: Some(base64::engine::general_purpose::STANDARD.encode(&template.ucx_address)),
            model: cfg.model_name(),
            fingerprint: fingerprint.clone(),
            capacity: serde_json::json!({"pages": cfg.max_pages, "sequences": cfg.max_sequences, "batch": cfg.max_batch}),
        };
        let etcd = EtcdConfig::new(cfg.etcd.clone(), EtcdConfig::members_prefix(&cfg.cluster));
        Some(Registration::start(etcd, member).await?)
    };
    tracing::info!(%url, model = %cfg.model_name(), fingerprint = %&fingerprint[..12], "decode worker serving");

    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(DecodeServer::new(service))
        .serve_with_incoming_shutdown(
            cluster::tls::incoming(listener, tls.as_ref().map(|t| t.internal_grpc()))?,
            shutdown.cancelled(),
        );
    // On SIGTERM: leave discovery and report NOT_SERVING first, so routers stop placing
    // work here, then let running requests finish (bounded by --drain-timeout-s).
    let on_stop = async {
        reporter.set_not_serving::<DecodeServer<service::DecodeService>>().await;
        if let Some(r) = registration {
            r.shutdown().await;
        }
    };
    let result = cluster::shutdown::drain(server, &shutdown, Duration::from_secs(cfg.drain_timeout_s), on_stop).await;
    // The server (and with it the engine's last sender) is gone: the engine thread drops
    // the engine; wait for that before the KV regions' UCX context and the process go.
    cluster::shutdown::join_thread(engine_thread, ENGINE_STOP_LIMIT, "decode engine").await;
    // Device memory stays registered until no peer can be writing it any more.
    drop(registrations);
    drop(receiver);
    result.map_err(WorkerError::from)
}

/// Longest wait at shutdown for the engine thread to drop the engine (its device
/// memory, CUDA contexts, NCCL communicators).
const ENGINE_STOP_LIMIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod memory_tests;
