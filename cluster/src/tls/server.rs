//! Server side: rustls configs for internal and public listeners, and accepting
//! connections for tonic (a stream) and axum (its `Listener`). TLS handshakes run in
//! their own tasks, bounded in time and number, so a peer that connects and says
//! nothing never holds up the accept loop.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;

use super::Live;
use super::conn::Conn;
use super::verify::{LiveClientVerifier, LiveIdentity};

/// Longest a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once per listener; beyond it new connections wait.
const MAX_HANDSHAKES: usize = 256;

/// gRPC speaks HTTP/2 only.
pub const ALPN_GRPC: &[&[u8]] = &[b"h2"];
/// HTTP APIs and `/metrics`: HTTP/2 or HTTP/1.1.
pub const ALPN_HTTP: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Who may connect to a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peers {
    /// Services of this cluster only: a client certificate chained to the cluster CA is
    /// required during the handshake.
    Services,
    /// Anyone (clients with API keys, scrapers, probes): no client certificate asked for.
    Anyone,
}

/// A server config that serves the live certificate and checks clients as `peers` says.
pub fn config(live: &Arc<Live>, peers: Peers, alpn: &[&[u8]]) -> Arc<ServerConfig> {
    let builder = ServerConfig::builder_with_provider(super::provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3");
    let builder = match peers {
        Peers::Services => builder.with_client_cert_verifier(Arc::new(LiveClientVerifier(live.clone()))),
        Peers::Anyone => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(Arc::new(LiveIdentity(live.clone())));
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A listener's accepted connections: plaintext, or TLS (handshakes done in the background).
pub enum Accepted {
    Plain(TcpListener),
    Tls { local: SocketAddr, rx: mpsc::Receiver<Conn>, acceptor: tokio::task::JoinHandle<()> },
}

impl Drop for Accepted {
    fn drop(&mut self) {
        // The accept task owns the socket: stop it so the port closes with the server.
        if let Accepted::Tls { acceptor, .. } = self {
            acceptor.abort();
        }
    }
}

/// Accept on `listener`, with TLS when `tls` is given. Must run inside a tokio runtime.
pub fn accept(listener: TcpListener, tls: Option<Arc<ServerConfig>>) -> io::Result<Accepted> {
    let Some(config) = tls else { return Ok(Accepted::Plain(listener)) };
    let local = listener.local_addr()?;
    let (tx, rx) = mpsc::channel(64);
    let acceptor = tokio::spawn(accept_loop(listener, TlsAcceptor::from(config), tx));
    Ok(Accepted::Tls { local, rx, acceptor })
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, tx: mpsc::Sender<Conn>) {
    let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let (tcp, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => {
                    let _ = tx.send(Conn::Tls(Box::new(tls))).await;
                }
                Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake refused"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

impl Accepted {
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Accepted::Plain(l) => l.local_addr(),
            Accepted::Tls { local, .. } => Ok(*local),
        }
    }

    fn poll_next_conn(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Conn>>> {
        match self {
            Accepted::Plain(l) => l.poll_accept(cx).map(|r| {
                Some(r.and_then(|(s, _)| {
                    // Small RPC messages must not wait for the peer's delayed ACK.
                    s.set_nodelay(true)?;
                    Ok(Conn::Plain(s))
                }))
            }),
            Accepted::Tls { rx, .. } => rx.poll_recv(cx).map(|c| c.map(Ok)),
        }
    }
}

/// The connections of `listener` as tonic's `serve_with_incoming*` takes them.
pub fn incoming(listener: TcpListener, tls: Option<Arc<ServerConfig>>) -> io::Result<Incoming> {
    accept(listener, tls).map(Incoming)
}

pub struct Incoming(Accepted);

impl Stream for Incoming {
    type Item = io::Result<Conn>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().0.poll_next_conn(cx)
    }
}

impl axum::serve::Listener for Accepted {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        loop {
            match std::future::poll_fn(|cx| self.poll_next_conn(cx)).await {
                Some(Ok(c)) => {
                    let addr = match &c {
                        Conn::Plain(s) => s.peer_addr(),
                        Conn::Tls(s) => s.get_ref().0.peer_addr(),
                    };
                    match addr {
                        Ok(a) => return (c, a),
                        Err(_) => continue, // gone already
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                // The accept task ended (it only does when aborted): nothing more comes.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Accepted::local_addr(self)
    }
}
