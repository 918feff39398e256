//! The faults the chaos suite injects into a running cluster, each followed by what a
//! supervisor (Kubernetes, systemd) or the operator would do, and the wait until the
//! cluster is whole again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cluster::testing::EtcdServer;
use sluice_e2e::{Placement, TestCluster};

use crate::load::{Case, Verdict, one};
use crate::partition::Netns;

/// How long a killed process stays down before its supervisor starts it again.
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// How long a disk stays full, or the store stalled.
const HOLD: Duration = Duration::from_secs(4);
/// How long a partition lasts: past the workers' etcd lease (5 s), so the router drops the
/// worker, and past the keep-alive that notices its streams are gone (5 + 3 s).
const PARTITION: Duration = Duration::from_secs(10);
/// A slow disk, approximated: the kvstore stopped for this long in every 200 ms.
const SLOW_STOPPED: Duration = Duration::from_millis(150);
/// Longest the cluster may take to be whole again after a fault is healed.
const RECOVERY_LIMIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    KillDecode,
    KillPrefill,
    KillKvstore,
    KillRouter,
    EtcdRestartEmpty,
    KvstoreDiskFull,
    KvstoreStalled,
    KvstoreSlow,
    PartitionDecode,
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::KillDecode => "kill -9 a decode worker (mid-stream), restart",
            Fault::KillPrefill => "kill -9 a prefill worker, restart",
            Fault::KillKvstore => "kill -9 the kvstore, restart on its files",
            Fault::KillRouter => "kill -9 the router, restart",
            Fault::EtcdRestartEmpty => "restart etcd empty (data lost)",
            Fault::KvstoreDiskFull => "kvstore disk full for 4 s",
            Fault::KvstoreStalled => "kvstore stalled 4 s (SIGSTOP: a disk that stops answering)",
            Fault::KvstoreSlow => "kvstore slowed 4 s (stopped 150 ms of every 200: a slow disk)",
            Fault::PartitionDecode => "partition a decode worker from etcd and its peers for 10 s, heal",
        }
    }

    /// The faults of one round; the disk-full fault needs a tmpfs mount and the
    /// partition a network namespace (root either way).
    pub fn round(with_disk: bool, with_partition: bool) -> Vec<Fault> {
        let mut v = vec![
            Fault::KillDecode,
            Fault::KillPrefill,
            Fault::KillKvstore,
            Fault::KillRouter,
            Fault::EtcdRestartEmpty,
            Fault::KvstoreStalled,
            Fault::KvstoreSlow,
        ];
        if with_disk {
            v.push(Fault::KvstoreDiskFull);
        }
        if with_partition {
            v.push(Fault::PartitionDecode);
        }
        v
    }
}

/// When a fault began and when the cluster was whole again.
#[derive(Clone, Debug)]
pub struct Window {
    pub fault: Fault,
    pub start: Instant,
    pub recovered: Instant,
}

/// The cluster under test and what the suite needs to restart its parts.
pub struct Chaos {
    pub cluster: TestCluster,
    pub etcd: EtcdServer,
    pub live_prefill: Vec<String>,
    pub live_decode: Vec<String>,
    next_index: usize,
    /// The kvstore's directory when it is a tmpfs of its own (the disk-full fault).
    pub kv_disk: Option<PathBuf>,
    /// Counters of processes that were killed, scraped just before (metrics restart at 0).
    pub carried: Counters,
    /// The namespace the partition fault cuts off, and the decode worker inside it.
    pub partition: Option<(Netns, String)>,
}

/// Counters summed over every incarnation of the router and the kvstore.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    pub migrations: f64,
    pub kv_write_errors: f64,
    pub kv_corrupt: f64,
}

impl Chaos {
    pub fn new(cluster: TestCluster, etcd: EtcdServer, kv_disk: Option<PathBuf>) -> Chaos {
        let names = |role: &str| {
            cluster.workers.iter().map(|w| w.name.clone()).filter(|n| n.starts_with(role)).collect::<Vec<_>>()
        };
        let (live_prefill, live_decode) = (names("prefill"), names("decode"));
        let next_index = live_prefill.len().max(live_decode.len());
        Chaos {
            cluster,
            etcd,
            live_prefill,
            live_decode,
            next_index,
            kv_disk,
            carried: Counters::default(),
            partition: None,
        }
    }

    /// Start one more decode worker inside `ns` (registering with etcd through a
    /// forwarder), the one the partition fault cuts off.
    pub async fn add_partitionable_decode(&mut self, mut ns: Netns) {
        let etcd = self.etcd.endpoint();
        let url = ns.forward(etcd.trim_start_matches("http://")).await;
        let at = Placement { prefix: ns.exec_prefix(), ip: Some(ns.inner_ip.clone()), etcd: Some(url) };
        let name = self.cluster.add_worker_placed("decode", self.next_index, vec![], &at).await;
        self.next_index += 1;
        self.live_decode.push(name.clone());
        self.partition = Some((ns, name));
    }

    /// Injects `fault`, heals it, and waits until the router sees every worker and a
    /// probe request answers exactly.
    pub async fn inject(&mut self, fault: Fault, probe: &Case, max_tokens: u32) -> Window {
        let start = Instant::now();
        eprintln!("chaos: {}", fault.name());
        match fault {
            Fault::KillDecode => self.kill_and_restart("decode").await,
            Fault::KillPrefill => self.kill_and_restart("prefill").await,
            Fault::KillKvstore => {
                self.carry_kvstore().await;
                self.cluster.stop_kvstore(true).await;
                tokio::time::sleep(RESTART_DELAY).await;
                self.cluster.start_kvstore().await;
            }
            Fault::KillRouter => {
                self.carried.migrations += self.counter("router", MIGRATED).await;
                self.cluster.restart_router(RESTART_DELAY).await;
            }
            Fault::EtcdRestartEmpty => {
                self.etcd.stop();
                std::fs::remove_dir_all(self.etcd.data_dir()).expect("wipe etcd's data");
                self.etcd.restart();
            }
            Fault::KvstoreDiskFull => {
                let dir = self.kv_disk.clone().expect("the disk-full fault needs the kvstore on a tmpfs");
                let filler = fill(&dir);
                tokio::time::sleep(HOLD).await;
                std::fs::remove_file(&filler).expect("remove the filler");
            }
            Fault::KvstoreStalled => {
                let pid = self.cluster.kvstore.as_ref().and_then(|k| k.pid()).expect("a running kvstore");
                signal(pid, "STOP");
                tokio::time::sleep(HOLD).await;
                signal(pid, "CONT");
            }
            Fault::KvstoreSlow => {
                let pid = self.cluster.kvstore.as_ref().and_then(|k| k.pid()).expect("a running kvstore");
                let until = Instant::now() + HOLD;
                while Instant::now() < until {
                    signal(pid, "STOP");
                    tokio::time::sleep(SLOW_STOPPED).await;
                    signal(pid, "CONT");
                    tokio::time::sleep(Duration::from_millis(200) - SLOW_STOPPED).await;
                }
            }
            Fault::PartitionDecode => {
                let (ns, _) = self.partition.as_ref().expect("the partition fault needs a network namespace");
                ns.cut();
                tokio::time::sleep(PARTITION).await;
                ns.heal();
            }
        }
        self.wait_whole(probe, max_tokens, start).await;
        let w = Window { fault, start, recovered: Instant::now() };
        eprintln!("chaos: whole again {:.1} s after the fault began", (w.recovered - start).as_secs_f64());
        w
    }

    /// `kill -9` the busiest live worker of `role`; its supervisor starts a new one.
    async fn kill_and_restart(&mut self, role: &str) {
        let inside = self.partition.as_ref().map(|(_, n)| n.clone());
        let live: Vec<String> = if role == "decode" { self.live_decode.clone() } else { self.live_prefill.clone() };
        // The worker inside the partition's namespace stays for that fault.
        let live: Vec<String> = live.into_iter().filter(|n| Some(n) != inside.as_ref()).collect();
        let mut victim = live[0].clone();
        if role == "decode" {
            // The one with the most running streams, so the kill lands mid-stream.
            let mut most = 0;
            for name in &live {
                let running = self.cluster.decode_load(name).await.running;
                if running > most {
                    (most, victim) = (running, name.clone());
                }
            }
        }
        self.cluster.kill_worker(&victim).await;
        tokio::time::sleep(RESTART_DELAY).await;
        let name = self.cluster.add_worker(role, self.next_index, vec![]).await;
        self.next_index += 1;
        let live = if role == "decode" { &mut self.live_decode } else { &mut self.live_prefill };
        live.retain(|n| n != &victim);
        live.push(name);
    }

    async fn carry_kvstore(&mut self) {
        self.carried.kv_write_errors += self.counter("kvstore", "sluice_kvstore_write_errors_total").await;
        self.carried.kv_corrupt += self.counter("kvstore", "sluice_kvstore_corrupt_records_total").await;
    }

    /// The current counters (the carried ones plus the live processes').
    pub async fn counters(&self) -> Counters {
        let c = self.carried;
        Counters {
            migrations: c.migrations + self.counter("router", MIGRATED).await,
            kv_write_errors: c.kv_write_errors + self.counter("kvstore", "sluice_kvstore_write_errors_total").await,
            kv_corrupt: c.kv_corrupt + self.counter("kvstore", "sluice_kvstore_corrupt_records_total").await,
        }
    }

    /// Sum of a counter's samples in a live service's exposition (0 when absent); `metric`
    /// may name label values too (`name{label="value"`: the samples that carry them).
    async fn counter(&self, service: &str, metric: &str) -> f64 {
        let name = match service {
            "kvstore" => self.cluster.kvstore.as_ref().map(|k| k.name.clone()),
            _ => Some(service.to_string()),
        };
        let Some(name) = name else { return 0.0 };
        let text = self.cluster.scrape(&name).await;
        text.lines()
            .filter(|l| l.starts_with(metric) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }

    /// Bounded: the router sees every live worker, and a probe request answers with the
    /// undisturbed run's tokens.
    async fn wait_whole(&self, probe: &Case, max_tokens: u32, since: Instant) {
        let (p, d) = (self.live_prefill.len(), self.live_decode.len());
        loop {
            let seen = match self.cluster.http_get("/health").await {
                Ok((200, body)) => {
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    v["prefill_workers"].as_u64().unwrap_or(0) >= p as u64
                        && v["decode_workers"].as_u64().unwrap_or(0) >= d as u64
                }
                _ => false,
            };
            if seen && one(&self.cluster.grpc, probe, max_tokens).await.verdict == Verdict::Ok {
                return;
            }
            assert!(since.elapsed() < RECOVERY_LIMIT, "the cluster was not whole again within {RECOVERY_LIMIT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Streams that were moved to another decode worker and went on (attempts that failed
/// are counted apart).
const MIGRATED: &str = "sluice_router_migrations_total{outcome=\"resumed\"";

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().map(|s| s.success());
    assert!(matches!(ok, Ok(true)), "kill -{sig} {pid}");
}

/// Fills the filesystem holding `dir` to the last byte; returns the filler file.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("chaos-filler");
    let mut f = std::fs::File::create(&path).expect("filler file");
    let chunk = vec![0u8; 1 << 20];
    // A tmpfs: writes fail with ENOSPC once it is full, then a byte at a time to the end.
    while f.write_all(&chunk).is_ok() {}
    while f.write_all(&[0u8]).is_ok() {}
    path
}

/// A tmpfs of `bytes` mounted on a fresh directory (the kvstore's disk for the
/// disk-full fault); unmounted on drop. `None` where mounting is not allowed.
pub struct Tmpfs {
    pub dir: tempfile::TempDir,
}

impl Tmpfs {
    pub fn mount(bytes: u64) -> Option<Tmpfs> {
        let dir = tempfile::Builder::new().prefix("sluice-chaos-kv-").tempdir().ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs { dir })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}
