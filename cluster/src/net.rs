//! Listening sockets and the addresses peers use to reach them.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Bind `addr`, with an error that says which address and why.
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e} (choose another address or port)"))
    })
}

/// Accepted connections of a gRPC server, with Nagle's algorithm off: tonic only sets
/// TCP_NODELAY on connections it accepts itself, and small RPC messages otherwise wait
/// for the peer's delayed ACK (~40 ms) before they go out.
pub fn incoming(
    listener: TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static {
    use futures::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        let s = s?;
        s.set_nodelay(true)?;
        Ok(s)
    })
}

/// The URL peers should use for a listener: `advertise` when given (the address other
/// hosts can reach), else the bound address (loopback or a specific interface); `https://`
/// when the listener serves TLS.
pub fn advertised_url(bound: SocketAddr, advertise: Option<&str>, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    match advertise {
        Some(a) => {
            let rest = a.strip_prefix("http://").or_else(|| a.strip_prefix("https://")).unwrap_or(a);
            format!("{scheme}://{rest}")
        }
        None => format!("{scheme}://{bound}"),
    }
}

/// Check a listen address (`host:port`, `[v6]:port`) without binding it.
pub fn check_listen(flag: &str, addr: &str) -> Result<(), String> {
    let port = addr.rsplit_once(':').map(|(_, p)| p);
    match port.map(str::parse::<u16>) {
        Some(Ok(_)) if !addr.starts_with(':') => Ok(()),
        _ => Err(format!("{flag} {addr:?}: expected host:port, e.g. 0.0.0.0:50051")),
    }
}

/// Check service endpoints (`http://host:port` or `host:port`), e.g. etcd's.
pub fn check_endpoints(flag: &str, endpoints: &[String]) -> Result<(), String> {
    for e in endpoints {
        let rest = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://")).unwrap_or(e);
        check_listen(flag, rest.trim_end_matches('/'))
            .map_err(|_| format!("{flag} {e:?}: expected http://host:port, e.g. http://etcd:2379"))?;
    }
    Ok(())
}

#[cfg(test)]
mod check_tests {
    use super::*;

    #[test]
    fn addresses_and_endpoints_are_checked_without_binding() {
        assert!(check_listen("--listen", "0.0.0.0:50051").is_ok());
        assert!(check_listen("--listen", "[::]:8080").is_ok());
        assert!(check_listen("--listen", "localhost").unwrap_err().contains("--listen"));
        assert!(check_listen("--listen", "host:99999").is_err());
        assert!(check_endpoints("--etcd", &["http://etcd-0.etcd:2379".into(), "10.0.0.1:2379".into()]).is_ok());
        assert!(check_endpoints("--etcd", &["http://etcd".into()]).unwrap_err().contains("--etcd"));
    }

    #[test]
    fn advertised_urls_name_the_transport() {
        let bound: SocketAddr = "127.0.0.1:5".parse().unwrap();
        assert_eq!(advertised_url(bound, None, false), "http://127.0.0.1:5");
        assert_eq!(advertised_url(bound, None, true), "https://127.0.0.1:5");
        assert_eq!(advertised_url(bound, Some("http://10.0.0.1:7"), true), "https://10.0.0.1:7");
        assert_eq!(advertised_url(bound, Some("10.0.0.1:7"), false), "http://10.0.0.1:7");
    }
}
