use clap::Parser;
use decode_worker::{DecodeConfig, run};

#[tokio::main]
async fn main() {
    let cfg = DecodeConfig::parse();
    if cfg.check_config {
        match cfg.validate_args() {
            Ok(()) => {
                println!("decode-worker: configuration ok");
                std::process::exit(0);
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        }
    }
    let telemetry = match cluster::telemetry::init("decode-worker") {
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
