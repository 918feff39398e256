//! Graceful shutdown: one token every task of a service watches, cancelled on SIGINT
//! or SIGTERM (what Kubernetes sends before killing a pod), and a bounded drain.

use std::future::Future;
use std::time::Duration;

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

/// Run a server until it ends or `shutdown` fires; then run `on_stop` (deregister,
/// report NOT_SERVING) so no new work is placed here, and give in-flight requests up to
/// `grace` to finish before returning. `server` must itself stop accepting on
/// `shutdown` (e.g. tonic's `serve_with_incoming_shutdown`). `on_stop` also runs when
/// the server ends on its own, so a registration never outlives its server.
pub async fn drain<E>(
    server: impl Future<Output = Result<(), E>>,
    shutdown: &CancellationToken,
    grace: Duration,
    on_stop: impl Future<Output = ()>,
) -> Result<(), E> {
    tokio::pin!(server);
    let early = tokio::select! {
        r = &mut server => Some(r),
        _ = shutdown.cancelled() => None,
    };
    on_stop.await;
    match early {
        Some(r) => r,
        None => match tokio::time::timeout(grace, server).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(
                    grace_s = grace.as_secs_f64(),
                    "in-flight requests did not finish in time; stopping anyway"
                );
                Ok(())
            }
        },
    }
}

/// Wait up to `limit` for a thread that owns device state (a worker's engine thread,
/// which drops the engine once the service's last sender is gone) to finish, so CUDA
/// contexts and NCCL communicators are torn down before the process exits instead of
/// racing its exit handlers (a worker over two GPUs crashed in `ncclCommAbort` that
/// way). Past `limit` it says so and returns; the process exits regardless.
pub async fn join_thread(handle: std::thread::JoinHandle<()>, limit: Duration, what: &str) {
    let deadline = tokio::time::Instant::now() + limit;
    while !handle.is_finished() {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(limit_s = limit.as_secs_f64(), "{what} thread still running; exiting without it");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if handle.join().is_err() {
        tracing::error!("{what} thread panicked while stopping");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn join_thread_waits_for_the_thread_and_bounds_the_wait() {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            d.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        join_thread(t, Duration::from_secs(5), "test").await;
        assert!(done.load(std::sync::atomic::Ordering::SeqCst), "returned before the thread finished");

        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let stuck = std::thread::spawn(move || {
            let _ = stop_rx.recv();
        });
        let started = std::time::Instant::now();
        join_thread(stuck, Duration::from_millis(100), "stuck").await;
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(5), "{waited:?}");
        drop(stop_tx);
    }

    #[tokio::test]
    async fn drain_bounds_the_wait_and_always_runs_on_stop() {
        let token = CancellationToken::new();
        token.cancel();
        let stopped = std::sync::atomic::AtomicBool::new(false);
        let never = std::future::pending::<Result<(), ()>>();
        let r = drain(never, &token, Duration::from_millis(50), async {
            stopped.store(true, std::sync::atomic::Ordering::SeqCst);
        })
        .await;
        assert_eq!(r, Ok(()));
        assert!(stopped.load(std::sync::atomic::Ordering::SeqCst));

        let stopped = std::sync::atomic::AtomicBool::new(false);
        let failed = async { Err::<(), &str>("bind failed") };
        let r = drain(failed, &CancellationToken::new(), Duration::from_secs(60), async {
            stopped.store(true, std::sync::atomic::Ordering::SeqCst);
        })
        .await;
        assert_eq!(r, Err("bind failed"));
        assert!(stopped.load(std::sync::atomic::Ordering::SeqCst), "deregisters when the server fails");
    }
}
