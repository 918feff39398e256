//! `sluice health`: one gRPC health check, exit 0 when SERVING. Kubernetes' native gRPC
//! probes speak plaintext only, so the Helm chart probes TLS ports with this instead
//! (presenting the pod's own certificate, which internal ports require).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use cluster::tls::{ClientTls, Dialer, Live, Paths};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(Args)]
pub struct HealthArgs {
    /// The gRPC address to check, e.g. https://127.0.0.1:50061.
    #[arg(long)]
    addr: String,
    /// The service whose status to ask for (empty: the server as a whole).
    #[arg(long, default_value = "")]
    service: String,
    /// Directory with `tls.crt`, `tls.key`, `ca.crt`: dial TLS and present that certificate.
    #[arg(long, env = "SLUICE_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Check the server's certificate for this name instead of the host in --addr.
    #[arg(long, env = "SLUICE_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
    /// Longest the whole check may take (ms).
    #[arg(long, default_value_t = 4000)]
    timeout_ms: u64,
}

pub fn run(a: HealthArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(check(a))
}

async fn check(a: HealthArgs) -> Result<()> {
    let dialer = match &a.tls_dir {
        Some(dir) => {
            let live = Live::load(Paths::in_dir(dir))?;
            Dialer::tls(ClientTls::with_identity(&live, a.tls_server_name.as_deref())?)
        }
        None => Dialer::plaintext(),
    };
    let ask = async {
        let ch = dialer.channel(&a.addr).await.map_err(anyhow::Error::msg)?;
        let reply = HealthClient::new(ch)
            .check(HealthCheckRequest { service: a.service.clone() })
            .await
            .with_context(|| format!("health check of {}", dialer.url(&a.addr)))?;
        anyhow::Ok(reply.into_inner().status)
    };
    let status = tokio::time::timeout(Duration::from_millis(a.timeout_ms), ask)
        .await
        .with_context(|| format!("{} did not answer within {} ms", a.addr, a.timeout_ms))??;
    if status != ServingStatus::Serving as i32 {
        bail!("{} reports {:?}", a.addr, ServingStatus::try_from(status).unwrap_or(ServingStatus::Unknown));
    }
    println!("SERVING");
    Ok(())
}
