use clap::Parser;
use router::{RouterConfig, run};

#[tokio::main]
async fn main() {
    let cfg = RouterConfig::parse();
    if cfg.check_config {
        match cfg.validate_args() {
            Ok(()) => {
                println!("router: configuration ok");
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
    let (grpc, http) = match (cluster::net::bind(&cfg.listen).await, cluster::net::bind(&cfg.http_listen).await) {
        (Ok(g), Ok(h)) => (g, h),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cfg, grpc, http, cluster::shutdown::on_signals()).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
