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
    let telemetry = match cluster::telemetry::init("router") {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let (grpc, http) = match (cluster::net::bind(&cfg.listen).await, cluster::net::bind(&cfg.http_listen).await) {
        (Ok(g), Ok(h)) => (g, h),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = run(cfg, grpc, http, cluster::shutdown::on_signals()).await;
    // Flush the spans not exported yet before exiting.
    telemetry.shutdown();
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
