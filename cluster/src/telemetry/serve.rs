//! `GET /metrics`: the Prometheus text exposition of a process's registry. The router
//! mounts [`routes`] on its HTTP API; workers [`serve`] it on their own listener
//! (`--metrics-listen`, nothing else on that port).

use std::sync::Arc;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Run before every scrape, for values cheaper to sample than to track (e.g. how many
/// workers are healthy right now).
pub type Refresh = Arc<dyn Fn() + Send + Sync>;

/// The value of `--metrics-listen` that turns the endpoint off.
pub const OFF: &str = "off";

/// Check a `--metrics-listen` value without binding it: `host:port` or `off`.
pub fn check_listen(flag: &str, addr: &str) -> Result<(), String> {
    if addr == OFF { Ok(()) } else { crate::net::check_listen(flag, addr) }
}

/// Bind a `--metrics-listen` address; `None` when it is `off`.
pub async fn bind(addr: &str) -> std::io::Result<Option<TcpListener>> {
    if addr == OFF { Ok(None) } else { crate::net::bind(addr).await.map(Some) }
}

/// A router serving `/metrics` from `registry`, calling `refresh` first when given.
pub fn routes(registry: Registry, refresh: Option<Refresh>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let (registry, refresh) = (registry.clone(), refresh.clone());
            async move {
                if let Some(f) = &refresh {
                    f();
                }
                ([(CONTENT_TYPE, prometheus::TEXT_FORMAT)], super::metrics::encode(&registry)).into_response()
            }
        }),
    )
}

/// Serve `/metrics` on `listener` until `shutdown`, over TLS when `tls` is given.
pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    refresh: Option<Refresh>,
    shutdown: CancellationToken,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!(url = %format!("{scheme}://{addr}/metrics"), "serving metrics");
    }
    let listener = crate::tls::accept(listener, tls)?;
    axum::serve(listener, routes(registry, refresh)).with_graceful_shutdown(shutdown.cancelled_owned()).await
}

/// Serve `/metrics` in the background (when `listener` is given) for as long as the
/// returned guard lives: a worker keeps answering scrapes while it drains.
pub fn spawn(
    listener: Option<TcpListener>,
    registry: Registry,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Option<tokio_util::sync::DropGuard> {
    let listener = listener?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        if let Err(e) = serve(listener, registry, None, s, tls).await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Some(stop.drop_guard())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_values() {
        assert!(check_listen("--metrics-listen", "off").is_ok());
        assert!(check_listen("--metrics-listen", "0.0.0.0:9100").is_ok());
        assert!(check_listen("--metrics-listen", "9100").unwrap_err().contains("--metrics-listen"));
    }

    #[tokio::test]
    async fn serves_the_exposition() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let registry = super::super::metrics::registry("test");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _guard = spawn(Some(listener), registry, None);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_string(&mut out)).await.unwrap().unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains("text/plain; version=0.0.4"), "{out}");
        assert!(out.contains(r#"sluice_build_info{service="test""#), "{out}");
    }
}
