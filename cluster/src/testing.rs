//! Test support: a real etcd server per test.
//!
//! Discovery is only worth testing against the real thing: lease expiry, watch cancellation and
//! the client's behaviour while the server is down are exactly what a fake would get wrong.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How to run the test etcd.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// The etcd binary; default: `$SLUICE_ETCD_BIN`, else `/usr/bin/etcd` if present, else `etcd`
    /// from `PATH`.
    pub binary: PathBuf,
    /// How long [`EtcdServer::start`] and [`EtcdServer::restart`] wait for the server to be healthy.
    pub startup_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        let binary = std::env::var_os("SLUICE_ETCD_BIN").map(PathBuf::from).unwrap_or_else(|| {
            let packaged = PathBuf::from("/usr/bin/etcd");
            if packaged.exists() { packaged } else { PathBuf::from("etcd") }
        });
        Self { binary, startup_timeout: Duration::from_secs(20) }
    }
}

/// A single-node etcd on free loopback ports with a temporary data directory; killed and cleaned
/// up on drop.
#[derive(Debug)]
pub struct EtcdServer {
    options: EtcdOptions,
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd with the default options; panics (with etcd's log) if it is not healthy in time.
    pub fn start() -> EtcdServer {
        Self::start_with(EtcdOptions::default())
    }

    pub fn start_with(options: EtcdOptions) -> EtcdServer {
        let dir = tempfile::Builder::new().prefix("sluice-etcd-").tempdir().expect("temporary etcd directory");
        let mut server = EtcdServer { options, dir, client_port: 0, peer_port: 0, child: None };
        // Free ports can be taken by someone else between our probe and etcd's bind; that is the
        // only start failure worth retrying.
        let mut attempt = 1;
        loop {
            server.client_port = free_port();
            server.peer_port = free_port();
            match server.launch() {
                Ok(()) => return server,
                Err(log) if attempt < 3 && log.contains("address already in use") => {
                    attempt += 1;
                    let _ = std::fs::remove_dir_all(server.data_dir());
                }
                Err(log) => panic!("etcd did not become healthy:\n{log}"),
            }
        }
    }

    /// The client URL, e.g. `http://127.0.0.1:40123`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint()]
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills etcd with SIGKILL, as a crash or a pulled cable would look to clients. The data
    /// directory survives for [`EtcdServer::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports and data directory; waits until it is healthy.
    pub fn restart(&mut self) {
        self.stop();
        if let Err(log) = self.launch() {
            panic!("etcd did not become healthy after a restart:\n{log}");
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Spawns etcd and waits until it is healthy; on failure returns the tail of its log.
    fn launch(&mut self) -> Result<(), String> {
        let log_path = self.log_path();
        let mut log = OpenOptions::new().create(true).append(true).open(&log_path).expect("etcd log file");
        let log_start = log.seek(SeekFrom::End(0)).unwrap_or(0);
        let _ = writeln!(log, "--- starting etcd on client port {} ---", self.client_port);
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&self.options.binary);
        command
            .arg("--name=sluice-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=sluice-test={peer_url}"))
            .arg("--initial-cluster-state=new")
            // A shorter election makes start and restart (which waits for a leader) quicker.
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .arg("--logger=zap")
            .arg("--log-outputs=stderr")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("etcd log file")))
            .stderr(Stdio::from(log));
        // Settings from the environment (ETCD_*) would silently override the flags above.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                command.env_remove(name);
            }
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot run {}: {e} (is etcd installed?)", self.options.binary.display()))?;
        self.child = Some(child);

        let deadline = Instant::now() + self.options.startup_timeout;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                return Err(format!("etcd exited with {status}\n{}", read_tail(&log_path, log_start)));
            }
            if healthy(self.client_port) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(format!(
                    "not healthy within {:?}\n{}",
                    self.options.startup_timeout,
                    read_tail(&log_path, log_start)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Asks etcd's `/health` endpoint over plain HTTP/1.1; true once there is a leader serving reads.
fn healthy(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let request = format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.1 200") && response.contains(r#""health":"true""#)
}

/// The last few kilobytes of the log written since `from`.
fn read_tail(path: &Path, from: u64) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        let _ = file.seek(SeekFrom::Start(from));
        let _ = file.read_to_string(&mut text);
    }
    let keep = 8192;
    if text.len() > keep {
        let mut cut = text.len() - keep;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        text.replace_range(..cut, "...");
    }
    text
}

/// A loopback port that nothing listens on right now and that this process has not handed
/// out before (outside the ephemeral range, so no outbound connection takes it meanwhile).
pub use crate::launch::free_port;
