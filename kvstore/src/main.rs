use clap::Parser;
use cluster::service_main::ServiceMain;
use kvstore::{KvstoreConfig, run};

#[tokio::main]
async fn main() {
    let cfg = KvstoreConfig::parse();
    let main = ServiceMain {
        name: "kvstore",
        check_config: cfg.check_config,
        listen: &cfg.listen.clone(),
        metrics_listen: &cfg.metrics_listen.clone(),
    };
    main.run(
        || cfg.validate_args(),
        || Ok(()),
        |listener, metrics, shutdown| run(cfg.clone(), listener, metrics, shutdown),
    )
    .await;
}
