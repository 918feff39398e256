//! Graceful shutdown: one token every task of a service watches, cancelled on SIGINT
//! or SIGTERM (what Kubernetes sends before killing a pod).

use tokio_util::sync::CancellationToken;

/// A token cancelled when the process receives SIGINT or SIGTERM.
pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C will stop this process");
                let _ = tokio::signal::ctrl_c().await;
                t.cancel();
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        }
        t.cancel();
    });
    token
}
