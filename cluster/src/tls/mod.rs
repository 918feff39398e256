//! Transport security every service shares (docs/security.md): TLS on every listener,
//! mutual TLS between services, certificates from files (a mounted Kubernetes TLS secret:
//! `tls.crt`, `tls.key`, `ca.crt`) that are re-read when they change.
//!
//! Two kinds of listener:
//! - internal (worker and kvstore gRPC ports): a peer must present a certificate that
//!   chains to the cluster CA, checked during the handshake, so no RPC of a peer without
//!   one ever reaches a handler;
//! - public (the router's gRPC and HTTP ports, every `/metrics` port): TLS without client
//!   certificates; clients authenticate with API keys (router), scrapers need none.
//!
//! Without TLS, services listen in plaintext on loopback addresses only, unless
//! `--insecure-plaintext` says otherwise.
//!
//! Module map:
//! - [`args`]: [`TlsArgs`], the flags every service flattens, their validation and the
//!   plaintext policy (loopback detection).
//! - [`material`]: PEM files → certificate chain, private key, trust roots.
//! - [`reload`]: the live material, re-read when the files change (a bounded mtime poll).
//! - [`verify`]: certificate resolvers and peer verifiers that follow the live material.
//! - [`server`]: rustls server configs and accepting TLS connections for tonic and axum.
//! - [`conn`]: an accepted connection, TLS or plaintext.
//! - [`client`]: [`Dialer`], how a service opens channels to its peers (with its identity).
//! - [`generate`]: throwaway CAs and certificates (rcgen) for `sluice up --tls` and tests.

pub mod args;
pub mod client;
pub mod conn;
pub mod generate;
pub mod material;
pub mod reload;
pub mod server;
pub mod verify;

use std::path::PathBuf;
use std::sync::Arc;

use thiserror::Error;

pub use args::{TlsArgs, is_loopback};
pub use client::{ClientTls, Dialer};
pub use conn::Conn;
pub use material::{Material, Paths, fingerprint};
pub use reload::Live;
pub use server::{Accepted, Peers, accept, incoming};

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("{0}")]
    Config(String),
    #[error("cannot generate certificates: {0}")]
    Generate(String),
}

/// The crypto provider every config names explicitly (no process-wide default needed).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A service's TLS: its live identity and trust, and the name peers' certificates are
/// checked against (when not the host of their URL).
#[derive(Clone)]
pub struct Tls {
    pub live: Arc<Live>,
    pub server_name: Option<String>,
}

impl Tls {
    /// Internal gRPC listeners: a cluster-CA client certificate is required.
    pub fn internal_grpc(&self) -> Arc<rustls::ServerConfig> {
        server::config(&self.live, Peers::Services, server::ALPN_GRPC)
    }

    /// Public gRPC listeners (the router's): no client certificate is asked for.
    pub fn public_grpc(&self) -> Arc<rustls::ServerConfig> {
        server::config(&self.live, Peers::Anyone, server::ALPN_GRPC)
    }

    /// Public HTTP listeners (the router's API, every `/metrics`): HTTP/2 or HTTP/1.1.
    pub fn public_http(&self) -> Arc<rustls::ServerConfig> {
        server::config(&self.live, Peers::Anyone, server::ALPN_HTTP)
    }

    /// How this service dials its peers: TLS with its own certificate as client identity.
    pub fn dialer(&self) -> Result<Dialer, TlsError> {
        Ok(Dialer::tls(ClientTls::with_identity(&self.live, self.server_name.as_deref())?))
    }
}

/// The dialer of a service with `tls` (plaintext without).
pub fn dialer(tls: Option<&Tls>) -> Result<Dialer, TlsError> {
    tls.map_or_else(|| Ok(Dialer::plaintext()), Tls::dialer)
}
