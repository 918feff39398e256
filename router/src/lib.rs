//! The router: the client-facing front door. It validates requests, picks a decode
//! worker (most free pages, smallest batch) and a prefill worker (shortest queue),
//! runs the KV handshake and prefill (retrying another prefill worker on failure), and
//! streams the decoded tokens back over gRPC (`sluice.v1.Generation`) or OpenAI-style
//! HTTP (`/v1/completions`).
//!
//! Module map:
//! - [`config`]: flags and environment, validated once.
//! - `model`: name, vocabulary, context limit and tokenizer of the served model.
//! - `validate`: request checks (INVALID_ARGUMENT messages that say what to change).
//! - `placement`: worker ranking (pure).
//! - `prefix`: what a prompt costs its prefill worker, counting the prefix cache.
//! - `workers`: gRPC channels per worker, membership, load polling.
//! - `orchestrate`: one request from admission to its last token.
//! - `relay`: what a request streamed so far (tokens, text state, latencies).
//! - `migrate`: continuing a request on another pair when its decode worker is lost.
//! - `stops`: stop strings over streamed text.
//! - [`chat`]: chat completions (V4 prompt encoding, structured output, reply parsing).
//! - `grpc`, `http`: the two APIs (the HTTP listener also serves `/metrics`); `request_id`:
//!   ids for both; `chat_http`: `/v1/chat/completions`, `chat_grpc`: `Chat` over gRPC,
//!   `chat_run`: starting a chat request for either API; `auth`: optional API keys (both
//!   APIs). TLS on both listeners and towards the workers comes from `cluster::tls`.
//! - [`inputs`]: every client request decoded and checked without I/O (what `fuzz/` drives).
//!
//! Telemetry (metrics, the `request` trace span and its children) is recorded in
//! `orchestrate`; the metric set and trace propagation live in `cluster::telemetry`.

mod auth;
pub mod chat;
mod chat_grpc;
mod chat_http;
mod chat_run;
pub mod config;
mod grpc;
mod http;
pub mod inputs;
mod migrate;
mod model;
mod orchestrate;
mod placement;
mod prefix;
mod relay;
mod request_id;
mod stops;
mod validate;
mod workers;

use std::sync::Arc;
use std::time::Duration;

use cluster::discovery::{EtcdConfig, Membership};
use sluice_proto::v1::generation_server::GenerationServer;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};

pub use config::RouterConfig;

#[derive(Debug, Error)]
pub enum RouterError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Discovery(#[from] cluster::discovery::DiscoveryError),
    #[error(transparent)]
    Tls(#[from] cluster::tls::TlsError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Serve gRPC on `grpc` and HTTP on `http` until `shutdown` is cancelled.
pub async fn run(
    cfg: RouterConfig,
    grpc: TcpListener,
    http: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), RouterError> {
    cfg.validate().map_err(RouterError::Config)?;
    let model = model::ModelInfo::load(&cfg.model, cfg.model_name()).map_err(RouterError::Config)?;
    let tls = cfg.tls.start(&cfg.listeners())?;
    let dialer = cluster::tls::dialer(tls.as_ref())?;
    let membership = match &cfg.peers {
        Some(p) => Membership::fixed(cluster::peers::parse_peers(p).map_err(RouterError::Config)?),
        None => {
            cluster::discovery::watch(EtcdConfig::new(cfg.etcd.clone(), EtcdConfig::members_prefix(&cfg.cluster)))
                .await?
        }
    };
    let registry = cluster::telemetry::metrics::registry("router");
    let metrics = cluster::telemetry::RouterMetrics::new(&registry);
    let workers = Arc::new(workers::WorkerSet::new(dialer.clone()));
    workers::spawn_maintenance(workers.clone(), membership, Duration::from_millis(cfg.load_poll_ms), shutdown.clone());
    let prefix = match &cfg.kvstore {
        Some(url) => Some(
            prefix::PrefixLookup::new(
                url,
                &dialer,
                Duration::from_millis(cfg.kvstore_lookup_timeout_ms),
                model_spec::BLOCK_TOKENS,
                model.window,
                model.layers,
            )
            .map_err(RouterError::Config)?,
        ),
        None => None,
    };
    let ctx = Arc::new(orchestrate::RouterCtx {
        prefix,
        model,
        workers,
        admission: Arc::new(Semaphore::new(cfg.max_concurrency)),
        max_concurrency: cfg.max_concurrency,
        request_timeout: Duration::from_secs(cfg.request_timeout_s),
        prefill_retries: cfg.prefill_retries,
        migration: migrate::MigrationLimits {
            attempts: cfg.migration_limit,
            attempt_timeout: Duration::from_secs(cfg.migration_timeout_s),
        },
        block_tokens: model_spec::BLOCK_TOKENS as u64,
        metrics: metrics.clone(),
    });
    // How many workers are healthy is sampled at each scrape, so it is never stale.
    let refresh: cluster::telemetry::serve::Refresh = {
        let workers = ctx.workers.clone();
        Arc::new(move || {
            let (p, d) = workers.healthy_counts();
            metrics.set_workers(p, d);
        })
    };
    let limits = || validate::Limits { max_tokens_limit: cfg.max_tokens_limit };

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<GenerationServer<grpc::GenerationService>>().await;
    let ids = request_id::RequestIds::new();
    let grpc_addr = grpc.local_addr()?;
    let http_addr = http.local_addr()?;
    let keys = cfg.api_keys_file.as_deref().map(auth::ApiKeys::load).transpose().map_err(RouterError::Config)?;
    let guard = auth::Guard { keys, metrics: ctx.metrics.clone() };
    let generation = grpc::GenerationService { ctx: ctx.clone(), limits: limits() };
    let grpc_server = tonic::transport::Server::builder()
        .layer(SetRequestIdLayer::x_request_id(ids.clone()))
        .layer(PropagateRequestIdLayer::x_request_id())
        .add_service(health)
        .add_service(GenerationServer::with_interceptor(generation, guard.clone()))
        .serve_with_incoming_shutdown(
            cluster::tls::incoming(grpc, tls.as_ref().map(|t| t.public_grpc()))?,
            shutdown.clone().cancelled_owned(),
        );
    let mut app = http::router(Arc::new(http::HttpState { ctx, limits: limits() }))
        .merge(cluster::telemetry::serve::routes(registry, Some(refresh)));
    if guard.keys.is_some() {
        app = app.layer(axum::middleware::from_fn_with_state(guard, auth::require_key));
    }
    let app = app.layer(PropagateRequestIdLayer::x_request_id()).layer(SetRequestIdLayer::x_request_id(ids));
    let http = cluster::tls::accept(http, tls.as_ref().map(|t| t.public_http()))?;
    let http_server = axum::serve(http, app).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    tracing::info!(
        grpc = %grpc_addr,
        http = %http_addr,
        tls = tls.is_some(),
        model = %cfg.model_name(),
        "router serving"
    );
    let (g, h) = tokio::join!(grpc_server, http_server);
    g?;
    h?;
    Ok(())
}
