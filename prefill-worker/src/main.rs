use clap::Parser;
use prefill_worker::{PrefillConfig, run};

#[tokio::main]
async fn main() {
    let cfg = PrefillConfig::parse();
    if cfg.check_config {
        match cfg.validate_args() {
            Ok(()) => {
                println!("prefill-worker: configuration ok");
                std::process::exit(0);
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        }
    }
    let telemetry = match cluster::telemetry::init("prefill-worker") {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Some(n) = cfg.threads
        && let Err(e) = engine::set_compute_threads(n)
    {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let (listener, metrics) =
        match (cluster::net::bind(&cfg.listen).await, cluster::telemetry::serve::bind(&cfg.metrics_listen).await) {
            (Ok(l), Ok(m)) => (l, m),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        };
    let result = run(cfg, listener, metrics, cluster::shutdown::on_signals()).await;
    // Flush the spans not exported yet before exiting.
    telemetry.shutdown();
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
