//! What the `main` of every single-listener service (prefill and decode workers, the
//! kvstore) does around its library's `run`: `--check-config`, telemetry, binding the
//! gRPC and metrics listeners, signals, and exit codes (2: bad configuration or
//! environment, 1: the service failed).

use std::fmt::Display;
use std::future::Future;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How a service wants to be run.
pub struct ServiceMain<'a> {
    /// Process name for messages and telemetry (`service.name`).
    pub name: &'static str,
    /// `--check-config` was given: validate and exit.
    pub check_config: bool,
    pub listen: &'a str,
    pub metrics_listen: &'a str,
}

fn exit_with(code: i32, e: impl Display) -> ! {
    eprintln!("error: {e}");
    std::process::exit(code)
}

impl ServiceMain<'_> {
    /// Validate (`validate` checks the arguments only), set up telemetry, run `prepare`
    /// (process-wide settings such as compute threads), bind, and run until SIGTERM or
    /// Ctrl-C. Exits the process on every error, with a message.
    pub async fn run<F, E>(
        self,
        validate: impl FnOnce() -> Result<(), String>,
        prepare: impl FnOnce() -> Result<(), String>,
        run: impl FnOnce(TcpListener, Option<TcpListener>, CancellationToken) -> F,
    ) where
        F: Future<Output = Result<(), E>>,
        E: Display,
    {
        if self.check_config {
            match validate() {
                Ok(()) => {
                    println!("{}: configuration ok", self.name);
                    std::process::exit(0);
                }
                Err(e) => exit_with(2, e),
            }
        }
        let telemetry = crate::telemetry::init(self.name).unwrap_or_else(|e| exit_with(2, e));
        if let Err(e) = prepare() {
            exit_with(2, e);
        }
        let listener = crate::net::bind(self.listen).await.unwrap_or_else(|e| exit_with(2, e));
        let metrics = crate::telemetry::serve::bind(self.metrics_listen).await.unwrap_or_else(|e| exit_with(2, e));
        let result = run(listener, metrics, crate::shutdown::on_signals()).await;
        // Flush the spans not exported yet before exiting.
        telemetry.shutdown();
        if let Err(e) = result {
            exit_with(1, e);
        }
    }
}
