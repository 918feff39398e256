//! Starting sluice services as child processes and waiting until they answer: what
//! `sluice up` does, and what end-to-end tests do to build a real cluster.
//!
//! Every child writes its log to a file; a child that exits while we wait for it
//! fails the wait at once with the end of its log, and every wait is bounded.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::process::{Child, Command};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("cannot start {name} ({program}): {reason}")]
    Spawn { name: String, program: String, reason: String },
    #[error("{name} exited ({status}) before it was ready; last log lines:\n{log}")]
    Exited { name: String, status: String, log: String },
    #[error("{name} was not ready after {secs}s; last log lines:\n{log}")]
    Timeout { name: String, secs: u64, log: String },
    #[error(
        "cannot find the `{0}` binary next to this program; build it (cargo build --release --workspace) or set SLUICE_BIN_DIR"
    )]
    NoBinary(String),
}

/// A free loopback TCP port for a child to listen on (bound and released). It comes from
/// below the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), at
/// random: a port `bind(0)` hands out is an ephemeral one, which any outbound connection
/// of any process may take as its local port in the seconds before the child binds it
/// (CI saw a router fail with "Address already in use" that way). A port is handed out
/// once per process (`sluice up` picks several before its children bind any; concurrent
/// tests in one process never collide). Falls back to `bind(0)` where no such range is free.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    const LOWEST: u32 = 10_000;
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let below = u32::from(ephemeral_ports().0);
    if below > LOWEST + 1_000 {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let mut x =
            now.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32) ^ CALLS.fetch_add(1, Ordering::Relaxed);
        for _ in 0..64 {
            // splitmix64: a well-spread candidate from each state.
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let port = (LOWEST + (z % u64::from(below - LOWEST)) as u32) as u16;
            if !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                handed_out.push(port);
                return port;
            }
        }
    }
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// The kernel's ephemeral port range (Linux's default where it cannot be read).
fn ephemeral_ports() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|v| v.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

/// Path of a sibling binary: `$SLUICE_BIN_DIR/<name>`, else next to the running
/// executable, else (for test executables in `target/<profile>/deps`) one level up.
pub fn find_binary(name: &str) -> Result<PathBuf, LaunchError> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("SLUICE_BIN_DIR") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        dirs.push(dir.to_path_buf());
        if let Some(up) = dir.parent() {
            dirs.push(up.to_path_buf());
        }
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file()).ok_or_else(|| LaunchError::NoBinary(name.into()))
}

pub struct ServiceProcess {
    pub name: String,
    /// The gRPC URL the service listens on.
    pub grpc_url: String,
    /// Where it serves Prometheus metrics (`http://host:port/metrics`), when it does.
    pub metrics_url: Option<String>,
    pub log: PathBuf,
    /// How health checks dial the service (TLS with a client certificate, when it serves TLS).
    dialer: crate::tls::Dialer,
    child: Child,
}

impl ServiceProcess {
    /// Start `program args…` with `env`, logging to `log_dir/<name>.log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        grpc_url: String,
        log_dir: &Path,
    ) -> Result<Self, LaunchError> {
        let err =
            |reason: String| LaunchError::Spawn { name: name.into(), program: program.display().to_string(), reason };
        std::fs::create_dir_all(log_dir).map_err(|e| err(e.to_string()))?;
        let log = log_dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(|e| err(e.to_string()))?;
        let errf = out.try_clone().map_err(|e| err(e.to_string()))?;
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(errf))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| err(e.to_string()))?;
        Ok(ServiceProcess {
            name: name.into(),
            grpc_url,
            metrics_url: None,
            log,
            dialer: crate::tls::Dialer::plaintext(),
            child,
        })
    }

    /// Note where the service serves its metrics.
    pub fn with_metrics_url(mut self, url: impl Into<String>) -> Self {
        self.metrics_url = Some(url.into());
        self
    }

    /// Check health over TLS (or plaintext) as `dialer` connects.
    pub fn with_dialer(mut self, dialer: crate::tls::Dialer) -> Self {
        self.dialer = dialer;
        self
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The last `n` lines of the service's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Whether the process has exited (and how), without waiting.
    pub fn exited(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(|s| s.to_string())
    }

    /// Wait until the service reports SERVING on gRPC health (bounded).
    pub async fn wait_healthy(&mut self, timeout: Duration) -> Result<(), LaunchError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Err(LaunchError::Exited { name: self.name.clone(), status, log: self.log_tail(20) });
            }
            if serving_with(&self.grpc_url, &self.dialer).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::Timeout {
                    name: self.name.clone(),
                    secs: timeout.as_secs(),
                    log: self.log_tail(20),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILL, as a crash would.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub async fn terminate(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").arg("-TERM").arg(pid.to_string()).status().await;
        }
        if tokio::time::timeout(grace, self.child.wait()).await.is_err() {
            self.kill().await;
        }
    }

    /// Wait for the process to exit on its own.
    pub async fn wait(&mut self) -> String {
        self.child.wait().await.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string())
    }
}

/// Whether the gRPC service at `url` answers health checks with SERVING (plaintext).
pub async fn serving(url: &str) -> bool {
    serving_with(url, &crate::tls::Dialer::plaintext()).await
}

/// Whether the gRPC service at `url`, dialed as `dialer` does, answers SERVING.
pub async fn serving_with(url: &str, dialer: &crate::tls::Dialer) -> bool {
    let Ok(ep) = dialer.endpoint(url) else { return false };
    let ep = ep.connect_timeout(Duration::from_millis(500));
    let connect = dialer.connect(&ep);
    let Ok(Ok(ch)) = tokio::time::timeout(Duration::from_secs(1), connect).await else { return false };
    let mut client = HealthClient::new(ch);
    let check = client.check(HealthCheckRequest { service: String::new() });
    matches!(
        tokio::time::timeout(Duration::from_secs(1), check).await,
        Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32
    )
}

#[cfg(test)]
mod port_tests {
    /// Ports come from below the ephemeral range, none twice, and each can be bound.
    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let below = super::ephemeral_ports().0;
        let ports: Vec<u16> = (0..50).map(|_| super::free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "a port handed out twice: {ports:?}");
        for &p in &ports {
            if below > 11_000 {
                assert!((10_000..below).contains(&p), "port {p} is not below the ephemeral range ({below}..)");
            }
            std::net::TcpListener::bind(("127.0.0.1", p)).unwrap_or_else(|e| panic!("port {p}: {e}"));
        }
    }
}
