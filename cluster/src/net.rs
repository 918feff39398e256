//! Listening sockets and the addresses peers use to reach them.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Bind `addr`, with an error that says which address and why.
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e} (choose another address or port)"))
    })
}

/// The URL peers should use for a listener: `advertise` when given (the address other
/// hosts can reach), else the bound address (loopback or a specific interface).
pub fn advertised_url(bound: SocketAddr, advertise: Option<&str>) -> String {
    match advertise {
        Some(a) if a.starts_with("http://") || a.starts_with("https://") => a.to_string(),
        Some(a) => format!("http://{a}"),
        None => format!("http://{bound}"),
    }
}
