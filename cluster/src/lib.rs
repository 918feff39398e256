//! What every sluice service shares about being part of a cluster.
//!
//! Module map:
//! - [`discovery`]: who is in the cluster. Workers announce themselves with a
//!   [`discovery::Registration`] (an etcd key under a kept-alive lease); the router follows
//!   membership through a [`discovery::Membership`], fed either by [`discovery::watch`] (etcd) or
//!   by [`discovery::Membership::fixed`] (a static `--peers` list on one machine).
//! - [`launch`]: services as child processes with bounded health waits (`sluice up`, e2e tests).
//! - [`peers`]: the static `--peers` list.
//! - [`net`]: listeners and advertised addresses.
//! - [`shutdown`]: a cancellation token for SIGINT/SIGTERM.
//! - [`service_main`]: what every service binary's `main` does around its `run`.
//! - [`telemetry`]: Prometheus metrics and their `/metrics` endpoint, logs, OTLP traces and
//!   W3C trace context across gRPC calls.
//! - [`tls`]: transport security: TLS on every listener, mutual TLS between services,
//!   certificates reloaded when their files change, the plaintext-on-loopback-only policy.
//! - `testing` (cargo feature `testing`): a real etcd server per test, for this crate's tests and
//!   for other crates' end-to-end tests.
#![forbid(unsafe_code)]

pub mod discovery;
pub mod launch;
pub mod net;
pub mod peers;
pub mod service_main;
pub mod shutdown;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
