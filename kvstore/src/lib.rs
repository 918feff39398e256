//! The kvstore: keeps the compressed KV of common prompt prefixes on SSD so prefill
//! workers restore them instead of recomputing (DESIGN §6). Control over gRPC
//! (`sluice.v1.KvStore`); record bytes over UCX — puts land in a registered staging
//! area, gets are written straight into the caller's registered KV memory.
//!
//! Module map:
//! - [`config`]: flags and environment, validated once.
//! - [`record`]: the on-disk record (header + payload, checksums, tombstones).
//! - [`segment`]: append-only segment files, scans that stop at torn tails.
//! - [`index`]: the in-memory index and the eviction order (pure logic).
//! - [`ranges`]: staging-area allocation (pure logic).
//! - [`store`]: the storage engine: index and queue, recovery, reads, deletes.
//! - `writer`: the disk writer thread: write-behind, capacity, compaction, eviction.
//! - `bulk`: the thread that writes gets into callers' memory over UCX.
//! - `service`: the gRPC adapter.
#![forbid(unsafe_code)]

mod bulk;
pub mod config;
pub mod index;
pub mod ranges;
pub mod record;
pub mod segment;
mod service;
pub mod store;
mod writer;

use std::sync::Arc;
use std::time::Duration;

use sluice_proto::v1::kv_store_server::KvStoreServer;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use transfer::{Landing, Receiver};

pub use config::KvstoreConfig;
pub use store::{Store, StoreConfig, StoreError};

#[derive(Debug, Error)]
pub enum KvstoreError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Transfer(#[from] transfer::TransferError),
    #[error(transparent)]
    Tls(#[from] cluster::tls::TlsError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Serve on `listener` (and `/metrics` on `metrics`) until `shutdown` is cancelled;
/// then finish requests (bounded) and write out what is queued.
pub async fn run(
    cfg: KvstoreConfig,
    listener: TcpListener,
    metrics: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), KvstoreError> {
    cfg.validate_args().map_err(KvstoreError::Config)?;
    let tls = cfg.tls.start(&cfg.listeners())?;
    let registry = cluster::telemetry::metrics::registry("kvstore");
    let recorder = cluster::telemetry::KvstoreMetrics::new(&registry);
    let store = tokio::task::block_in_place(|| Store::open(cfg.store(), recorder.clone()))?;
    let receiver = Receiver::start()?;
    let landing = Landing::allocate(&receiver, cfg.staging_bytes as usize)?;
    let bulk = bulk::Bulk::start()?;
    let service = Arc::new(service::KvService::new(
        store.clone(),
        cfg.swa_policy,
        recorder,
        landing,
        receiver.address().to_vec(),
        bulk,
        cfg.put_lease(),
        cfg.get_timeout(),
    ));
    let _metrics = cluster::telemetry::serve::spawn(metrics, registry, tls.as_ref().map(|t| t.public_http()));
    let sweeper = tokio::spawn({
        let service = service.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let n = service.expire_puts();
                if n > 0 {
                    tracing::debug!(puts = n, "put leases ended before their commits; staging reclaimed");
                }
            }
        }
    });

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<KvStoreServer<service::Shared>>().await;
    let bound = listener.local_addr()?;
    tracing::info!(
        addr = %bound,
        dir = %cfg.dir.display(),
        capacity = cfg.capacity,
        swa_policy = %cfg.swa_policy,
        "kvstore serving"
    );
    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(KvStoreServer::new(service::Shared(service)))
        .serve_with_incoming_shutdown(
            cluster::tls::incoming(listener, tls.as_ref().map(|t| t.internal_grpc()))?,
            shutdown.cancelled(),
        );
    let on_stop = async {
        reporter.set_not_serving::<KvStoreServer<service::Shared>>().await;
    };
    let result = cluster::shutdown::drain(server, &shutdown, Duration::from_secs(cfg.drain_timeout_s), on_stop).await;
    sweeper.abort();
    // Queued records are written out before exiting (the queue is bounded).
    tokio::task::block_in_place(|| store.shutdown());
    drop(receiver);
    result.map_err(KvstoreError::from)
}
