//! Client side: how a service (or a tool) dials gRPC peers. With TLS every connection is
//! TLS, whatever scheme a URL names (a cluster is TLS or it is not; an `http://` left in
//! a peer list must not quietly dial plaintext), the peer's certificate must chain to the
//! cluster CA, and the service presents its own certificate.
//!
//! tonic's own TLS takes fixed certificates; here a connector does the handshake with the
//! live material, so a renewed client certificate is used from the next connection on.

use std::io;
use std::path::Path;
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::verify::{LiveIdentity, LiveServerVerifier};
use super::{Live, TlsError};

/// A TLS client: whom it trusts, what it presents (if anything), what name it checks.
#[derive(Clone)]
pub struct ClientTls {
    grpc: Arc<ClientConfig>,
    http1: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

fn server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(name.to_string()).map_err(|_| TlsError::Config(format!("{name:?} is not a DNS name or IP")))
}

impl ClientTls {
    fn build(
        verifier: Arc<dyn ServerCertVerifier>,
        identity: Option<Arc<LiveIdentity>>,
        name: Option<&str>,
    ) -> Result<Self, TlsError> {
        let builder = ClientConfig::builder_with_provider(super::provider())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let base = match identity {
            Some(id) => builder.with_client_cert_resolver(id),
            None => builder.with_no_client_auth(),
        };
        let with_alpn = |alpn: &[u8]| {
            let mut c = base.clone();
            c.alpn_protocols = vec![alpn.to_vec()];
            Arc::new(c)
        };
        Ok(ClientTls {
            grpc: with_alpn(b"h2"),
            http1: with_alpn(b"http/1.1"),
            server_name: name.map(server_name).transpose()?,
        })
    }

    /// A service's client: trusts the live cluster CA and presents the live certificate;
    /// checks peers for `name` when given, else for the host it dials.
    pub fn with_identity(live: &Arc<Live>, name: Option<&str>) -> Result<Self, TlsError> {
        Self::build(Arc::new(LiveServerVerifier(live.clone())), Some(Arc::new(LiveIdentity(live.clone()))), name)
    }

    /// A client without a certificate of its own (an API client of the router) trusting
    /// the CA certificates in the PEM file `ca`.
    pub fn trusting(ca: &Path, name: Option<&str>) -> Result<Self, TlsError> {
        let pem = std::fs::read(ca).map_err(|e| TlsError::File { path: ca.into(), reason: e.to_string() })?;
        let roots = super::material::roots(&pem, ca)?;
        let verifier = WebPkiServerVerifier::builder_with_provider(roots, super::provider())
            .build()
            .map_err(|e| TlsError::File { path: ca.into(), reason: e.to_string() })?;
        Self::build(verifier, None, name)
    }

    /// A TLS stream to `host:port` (gRPC's ALPN `h2`, or `http/1.1` when `http1`).
    pub async fn connect(&self, host: &str, port: u16, http1: bool) -> io::Result<TlsStream<TcpStream>> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let tcp = TcpStream::connect((host, port)).await?;
        tcp.set_nodelay(true)?;
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => server_name(host).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?,
        };
        let config = if http1 { self.http1.clone() } else { self.grpc.clone() };
        TlsConnector::from(config).connect(name, tcp).await
    }
}

/// How a process dials gRPC peers: plaintext, or TLS.
#[derive(Clone, Default)]
pub struct Dialer {
    tls: Option<ClientTls>,
}

impl Dialer {
    pub fn plaintext() -> Self {
        Dialer { tls: None }
    }

    pub fn tls(tls: ClientTls) -> Self {
        Dialer { tls: Some(tls) }
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    pub fn client_tls(&self) -> Option<&ClientTls> {
        self.tls.as_ref()
    }

    /// The URL to show for `addr` (`host:port`, `http://…` or `https://…`): `https://`
    /// with TLS, `http://` without.
    pub fn url(&self, addr: &str) -> String {
        let rest = addr.strip_prefix("http://").or_else(|| addr.strip_prefix("https://")).unwrap_or(addr);
        format!("{}://{rest}", if self.is_tls() { "https" } else { "http" })
    }

    /// An endpoint for `addr` to configure (timeouts, keep-alive) and then open with
    /// [`Dialer::lazy`] or [`Dialer::connect`]. The handshake is the connector's, so the
    /// endpoint itself always names `http://`.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, String> {
        if addr.starts_with("https://") && !self.is_tls() {
            return Err(format!("{addr}: an https:// address, but TLS is off (give --tls-dir)"));
        }
        let rest = addr.strip_prefix("http://").or_else(|| addr.strip_prefix("https://")).unwrap_or(addr);
        Endpoint::from_shared(format!("http://{rest}")).map_err(|e| format!("{addr}: {e}"))
    }

    /// A channel that connects on first use (and again after failures).
    pub fn lazy(&self, endpoint: &Endpoint) -> Channel {
        match &self.tls {
            None => endpoint.connect_lazy(),
            Some(tls) => endpoint.connect_with_connector_lazy(connector(tls.clone())),
        }
    }

    /// A channel, connected now.
    pub async fn connect(&self, endpoint: &Endpoint) -> Result<Channel, tonic::transport::Error> {
        match &self.tls {
            None => endpoint.connect().await,
            Some(tls) => endpoint.connect_with_connector(connector(tls.clone())).await,
        }
    }

    /// [`Dialer::endpoint`] and [`Dialer::connect`] in one, for tools and tests.
    pub async fn channel(&self, addr: &str) -> Result<Channel, String> {
        let ep = self.endpoint(addr)?;
        self.connect(&ep).await.map_err(|e| format!("cannot connect to {}: {e}", self.url(addr)))
    }
}

type Connecting = std::pin::Pin<Box<dyn Future<Output = io::Result<TokioIo<TlsStream<TcpStream>>>> + Send>>;

fn connector(
    tls: ClientTls,
) -> impl tower::Service<Uri, Response = TokioIo<TlsStream<TcpStream>>, Error = io::Error, Future = Connecting>
+ Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: Uri| {
        let tls = tls.clone();
        Box::pin(async move {
            let host =
                uri.host().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{uri}: no host")))?;
            let port = uri.port_u16().unwrap_or(443);
            tls.connect(host, port, false).await.map(TokioIo::new)
        }) as Connecting
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_follow_the_transport() {
        let plain = Dialer::plaintext();
        assert_eq!(plain.url("127.0.0.1:5"), "http://127.0.0.1:5");
        assert_eq!(plain.endpoint("http://127.0.0.1:5").unwrap().uri().to_string(), "http://127.0.0.1:5/");
        // `host:port` gets a scheme (e.g. `--kvstore kvstore:50070`).
        assert_eq!(plain.endpoint("kvstore:50070").unwrap().uri().to_string(), "http://kvstore:50070/");
        assert!(plain.endpoint("https://127.0.0.1:5").unwrap_err().contains("TLS is off"));
    }
}
