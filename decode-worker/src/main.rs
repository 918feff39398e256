use clap::Parser;
use cluster::service_main::ServiceMain;
use decode_worker::{DecodeConfig, run};

#[tokio::main]
async fn main() {
    let cfg = DecodeConfig::parse();
    let main = ServiceMain {
        name: "decode-worker",
        check_config: cfg.check_config,
        listen: &cfg.listen.clone(),
        metrics_listen: &cfg.metrics_listen.clone(),
    };
    main.run(
        || cfg.validate_args(),
        || match cfg.threads {
            Some(n) => engine::set_compute_threads(n),
            None => Ok(()),
        },
        |listener, metrics, shutdown| run(cfg.clone(), listener, metrics, shutdown),
    )
    .await;
}
