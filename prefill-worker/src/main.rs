use clap::Parser;
use cluster::service_main::ServiceMain;
use prefill_worker::{PrefillConfig, run};

#[tokio::main]
async fn main() {
    let cfg = PrefillConfig::parse();
    let main = ServiceMain {
        name: "prefill-worker",
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
