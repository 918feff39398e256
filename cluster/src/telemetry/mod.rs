//! Telemetry every sluice process shares (DESIGN §9): Prometheus metrics at `/metrics`,
//! logs with the request id, and OpenTelemetry traces exported over OTLP whose context
//! crosses every gRPC hop, so one request is one trace across router, prefill and
//! decode workers. docs/metrics.md is the operator's reference.
//!
//! Module map:
//! - [`metrics`]: registry, metric names, latency buckets, `sluice_build_info`, status labels.
//! - [`catalog`]: the metric set of each service (router, prefill worker, decode worker).
//! - [`kvstore`]: the kvstore's metric set.
//! - [`serve`]: the `/metrics` HTTP endpoint (and `--metrics-listen` parsing).
//! - [`tracing_init`]: the log subscriber with optional OTLP export; its guard flushes at exit.
//! - [`propagation`]: W3C trace context in gRPC metadata (inject, extract, client interceptor).

pub mod catalog;
pub mod kvstore;
pub mod metrics;
pub mod propagation;
pub mod serve;
pub mod tracing_init;

pub use catalog::{DecodeMetrics, PrefillMetrics, RouterMetrics};
pub use kvstore::KvstoreMetrics;
pub use opentelemetry::Context as TraceContext;
pub use prometheus::{self, Registry};
pub use tracing_init::{TracingGuard, init};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TelemetryError {
    #[error("OTLP trace exporter: {0} (check OTEL_EXPORTER_OTLP_ENDPOINT, e.g. http://otel-collector:4317)")]
    Exporter(String),
    #[error("cannot install the log subscriber: {0}")]
    Subscriber(String),
}
