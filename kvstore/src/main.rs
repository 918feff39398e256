use clap::Parser;
use kvstore::{KvstoreConfig, run};

#[tokio::main]
async fn main() {
    let cfg = KvstoreConfig::parse();
    if cfg.check_config {
        match cfg.validate_args() {
            Ok(()) => {
                println!("kvstore: configuration ok");
                std::process::exit(0);
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        }
    }
    let telemetry = match cluster::telemetry::init("kvstore") {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let (listener, metrics) =
        match (cluster::net::bind(&cfg.listen).await, cluster::telemetry::serve::bind(&cfg.metrics_listen).await) {
            (Ok(l), Ok(m)) => (l, m),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        };
    let result = run(cfg, listener, metrics, cluster::shutdown::on_signals()).await;
    telemetry.shutdown();
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
