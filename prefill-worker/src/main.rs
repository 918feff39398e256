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
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Some(n) = cfg.threads
        && let Err(e) = engine::set_compute_threads(n)
    {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let listener = match cluster::net::bind(&cfg.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cfg, listener, cluster::shutdown::on_signals()).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
