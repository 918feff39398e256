//! `sluice bench kvstore`: sequential write and read throughput of KV pages through the
//! kvstore service — BeginPut, UCX writes into its staging, CommitPut, then the writer
//! putting them on disk; Get, the store reading them from disk and writing them into
//! this process's registered memory — next to `fio` on the same directory, in the same
//! run.
//!
//! Both sides do the same work: `--total` bytes in records of `--record-bytes` (by
//! default one DeepSeek-V4-Flash page in bf16), written sequentially and made durable
//! (fio: `--end_fsync=1`; the store: its segment files fsynced once its writer has
//! drained), then read back sequentially after the files were dropped from the page
//! cache (fio: `--invalidate=1`; the store's files: `dd iflag=nocache count=0`). Every
//! record read through the store is checked against its checksum.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use cluster::launch::{ServiceProcess, find_binary, free_port};
use serde_json::{Value, json};
use sluice_proto::v1 as pb;
use sluice_proto::v1::kv_store_client::KvStoreClient;
use tonic::transport::Channel;
use transfer::checksum::kv_checksum;
use transfer::{Landing, Receiver, RegionSpec, RemoteWrite, Sender};

/// One V4-Flash page in bf16: 21 CSA layers × 32 entries × (512 + 128 indexer dims)
/// plus 20 HCA layers × 1 entry × 512 dims, 2 bytes each.
const FLASH_PAGE_BYTES: u64 = (21 * 32 * (512 + 128) + 20 * 512) * 2;

#[derive(Args)]
pub struct KvstoreArgs {
    /// Directory to measure (the store's segments and fio's file go under it). Default:
    /// a new directory under the system temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Bytes written and read by each side.
    #[arg(long, default_value = "2GiB", value_parser = kvstore::config::parse_bytes)]
    total: u64,
    /// Bytes per record (and fio's block size).
    #[arg(long, default_value_t = FLASH_PAGE_BYTES)]
    record_bytes: u64,
    /// Records per put and per get (a 4K-token prefix is 32 blocks).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The fio binary to compare with.
    #[arg(long, default_value = "fio")]
    fio: PathBuf,
    /// `UCX_TLS` of the store and this client (shared memory: both run on this host).
    /// An explicit UCX_TLS in the environment wins.
    #[arg(long, default_value = "shm")]
    tls: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

struct Row {
    op: &'static str,
    sluice: f64,
    fio: f64,
}

pub fn run(a: KvstoreArgs) -> Result<()> {
    ensure!(a.record_bytes >= 4096 && a.batch > 0, "--record-bytes must be at least 4096 and --batch at least 1");
    // UCX reads UCX_TLS when this process creates its contexts: run again with it set.
    if std::env::var_os("UCX_TLS").is_none() {
        let mut again = Command::new(std::env::current_exe()?);
        again.args(std::env::args_os().skip(1)).env("UCX_TLS", &a.tls);
        // UCX logs to stdout by default; keep stdout for the report.
        if std::env::var_os("UCX_LOG_FILE").is_none() {
            again.env("UCX_LOG_FILE", "/dev/stderr");
        }
        let status = again.status().context("running the benchmark again with UCX_TLS set")?;
        ensure!(status.success(), "the benchmark failed ({status})");
        return Ok(());
    }
    let records = (a.total / a.record_bytes).max(a.batch as u64) as usize;
    let root = match &a.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("sluice-bench-kvstore-{}", std::process::id())),
    };
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let store_dir = root.join("store");
    let _ = std::fs::remove_dir_all(&store_dir);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (write, read) = rt.block_on(through_store(&a, &store_dir, records))?;
    let bytes = records as u64 * a.record_bytes;
    let fio_write = fio(&a, &root, "write", bytes)?;
    let fio_read = fio(&a, &root, "read", bytes)?;
    let _ = std::fs::remove_file(root.join("fio.dat"));
    let _ = std::fs::remove_dir_all(&store_dir);
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&root);
    }
    let rows = [
        Row { op: "sequential write", sluice: bytes as f64 / write / 1e9, fio: fio_write },
        Row { op: "sequential read", sluice: bytes as f64 / read / 1e9, fio: fio_read },
    ];
    if a.json {
        let out: Vec<Value> = rows
            .iter()
            .map(|r| json!({"op": r.op, "sluice_gbps": r.sluice, "fio_gbps": r.fio, "ratio": r.sluice / r.fio}))
            .collect();
        println!("{}", json!({"records": records, "record_bytes": a.record_bytes, "rows": out}));
    } else {
        println!("{records} records of {} B ({:.2} GB) in {}", a.record_bytes, bytes as f64 / 1e9, root.display());
        println!("| operation | sluice kvstore GB/s | fio GB/s | sluice ÷ fio |");
        println!("|---|---:|---:|---:|");
        for r in &rows {
            println!("| {} | {:.2} | {:.2} | {:.2} |", r.op, r.sluice, r.fio, r.sluice / r.fio);
        }
    }
    Ok(())
}

fn record_bytes(i: usize, len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ i as u64;
    (0..len / 8)
        .flat_map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            x.to_le_bytes()
        })
        .collect()
}

fn key(i: usize) -> Vec<u8> {
    let mut k = vec![0u8; 32];
    k[..8].copy_from_slice(&(i as u64).to_le_bytes());
    k[31] = 0xb7;
    k
}

/// Seconds to write `records` records through the store and make them durable, and to
/// read them back from a cold page cache.
async fn through_store(a: &KvstoreArgs, dir: &Path, records: usize) -> Result<(f64, f64)> {
    let len = a.record_bytes as usize;
    let batch_bytes = (a.batch * len) as u64;
    let port = free_port();
    let capacity = (records as u64 * (a.record_bytes + 256)) * 2 + (1 << 30);
    let args: Vec<String> = vec![
        "--dir".into(),
        dir.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--metrics-listen".into(),
        "off".into(),
        "--swa-policy".into(),
        "zero".into(),
        "--capacity".into(),
        capacity.to_string(),
        "--segment-bytes".into(),
        (256u64 << 20).max(a.record_bytes * 2).to_string(),
        "--staging-bytes".into(),
        (batch_bytes * 2).max(512 << 20).to_string(),
        "--queue-bytes".into(),
        (1u64 << 30).max(batch_bytes * 2).to_string(),
    ];
    let url = format!("http://127.0.0.1:{port}");
    let logs = tempfile::tempdir()?;
    let mut store = ServiceProcess::spawn("kvstore", &find_binary("kvstore")?, &args, &[], url.clone(), logs.path())?;
    store.wait_healthy(Duration::from_secs(60)).await?;
    let result = async {
        let mut client = KvStoreClient::connect(url).await?;
        let data: Vec<Vec<u8>> = (0..a.batch).map(|i| record_bytes(i, len)).collect();
        let mut sender = Sender::new()?;
        let started = Instant::now();
        let mut pending = None;
        for first in (0..records).step_by(a.batch) {
            let n = a.batch.min(records - first);
            let commit = put_batch(&mut client, &mut sender, first, &data[..n]).await?;
            if let Some(previous) = pending.replace(commit) {
                previous.await??;
            }
        }
        if let Some(last) = pending {
            last.await??;
        }
        let offered = started.elapsed().as_secs_f64();
        wait_drained(&mut client).await?;
        let drained = started.elapsed().as_secs_f64();
        for seg in kvstore::segment::list(dir)? {
            std::fs::File::open(kvstore::segment::path(dir, seg))?.sync_all()?;
        }
        let write = started.elapsed().as_secs_f64();
        eprintln!("write phases: puts committed {offered:.2} s, writer drained {drained:.2} s, fsynced {write:.2} s");

        for seg in kvstore::segment::list(dir)? {
            drop_cache(&kvstore::segment::path(dir, seg))?;
        }
        let rx = Receiver::start()?;
        let landing = Landing::allocate(&rx, batch_bytes as usize)?;
        let sums: Vec<u64> = data.iter().map(|d| kv_checksum(d)).collect();
        let mut read = Duration::ZERO;
        for first in (0..records).step_by(a.batch) {
            let n = a.batch.min(records - first);
            let t = Instant::now();
            let reply = get_batch(&mut client, &rx, &landing, first, n, len).await?;
            read += t.elapsed();
            for (i, &sum) in sums.iter().enumerate().take(n) {
                ensure!(reply.checksums[i] == sum, "record {} came back with another checksum", first + i);
                ensure!(kv_checksum(landing.bytes(i * len, len)) == sum, "record {} landed damaged", first + i);
            }
        }
        Ok::<_, anyhow::Error>((write, read.as_secs_f64()))
    }
    .await;
    store.terminate(Duration::from_secs(30)).await;
    result
}

/// Offer and write one batch; returns its commit, running.
async fn put_batch(
    client: &mut KvStoreClient<Channel>,
    sender: &mut Sender,
    first: usize,
    data: &[Vec<u8>],
) -> Result<tokio::task::JoinHandle<Result<()>>> {
    let records: Vec<pb::PutRecord> = (0..data.len())
        .map(|i| pb::PutRecord {
            key: key(first + i),
            parent: if first + i == 0 { vec![] } else { key(first + i - 1) },
            depth: (first + i) as u32,
            kind: pb::RecordKind::Page as i32,
            len: data[i].len() as u64,
            pools: Some(pb::PoolBytes { csa_main: data[i].len() as u64, ..Default::default() }),
        })
        .collect();
    // The keys are new, so a decline means the staging area is full of records the disk
    // writer has not written yet: wait for it (a prefill worker would drop the put).
    let deadline = Instant::now() + Duration::from_secs(60);
    let reply = loop {
        let reply = client.begin_put(pb::BeginPutRequest { records: records.clone() }).await?.into_inner();
        if reply.accepted.iter().all(|a| *a) {
            break reply;
        }
        ensure!(Instant::now() < deadline, "the store kept declining records for a minute");
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let staging = reply.staging.as_ref().context("no staging region")?;
    let staging = RegionSpec { base: staging.base, len: staging.len, rkey: staging.rkey.clone() };
    let writes: Vec<RemoteWrite<'_>> = data
        .iter()
        .zip(&reply.offsets)
        .map(|(d, &offset)| RemoteWrite { region: &staging, offset, source: transfer::Source::Host(d) })
        .collect();
    sender.write(&reply.ucx_address, &writes, Duration::from_secs(60))?;
    let checksums = data.iter().map(|d| kv_checksum(d)).collect();
    // The commit runs while the next batch is offered and written (two in flight, as two
    // prefill workers putting at once would have).
    let mut client = client.clone();
    Ok(tokio::spawn(async move {
        let done = client.commit_put(pb::CommitPutRequest { put_id: reply.put_id, checksums }).await?.into_inner();
        ensure!(done.rejected == 0, "the store rejected {} records (write queue full?)", done.rejected);
        Ok(())
    }))
}

async fn get_batch(
    client: &mut KvStoreClient<Channel>,
    rx: &Receiver,
    landing: &Landing,
    first: usize,
    n: usize,
    len: usize,
) -> Result<pb::GetReply> {
    let req = pb::GetRequest {
        keys: (first..first + n).map(key).collect(),
        kinds: vec![pb::RecordKind::Page as i32; n],
        ucx_address: rx.address().to_vec(),
        regions: vec![pb::RemoteRegion {
            base: landing.spec.base,
            len: landing.spec.len,
            rkey: landing.spec.rkey.clone(),
        }],
        pieces: (0..n)
            .map(|i| pb::Piece { record: i as u32, region: 0, offset: (i * len) as u64, len: len as u64 })
            .collect(),
        deadline_ms: 0,
    };
    Ok(client.get(req).await?.into_inner())
}

async fn wait_drained(client: &mut KvStoreClient<Channel>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let s = client.stats(pb::KvStatsRequest {}).await?.into_inner();
        ensure!(s.write_errors == 0, "the store could not write ({} errors): is the disk full?", s.write_errors);
        if s.queued_records == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the store's writer did not drain in 10 minutes: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Drop a file's pages from the page cache (clean pages only; it was fsynced).
fn drop_cache(path: &Path) -> Result<()> {
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["iflag=nocache", "count=0", "status=none"])
        .output()
        .context("running dd (coreutils) to drop the page cache")?;
    ensure!(out.status.success(), "dd iflag=nocache: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// fio's GB/s for a sequential `rw` (write or read) of `bytes` on one file in `dir`,
/// over its wall time (start to exit, the final fsync included), as the store's is
/// timed.
fn fio(a: &KvstoreArgs, dir: &Path, rw: &str, bytes: u64) -> Result<f64> {
    let started = Instant::now();
    let out = Command::new(&a.fio)
        .args([
            format!("--name=seq{rw}"),
            format!("--filename={}", dir.join("fio.dat").display()),
            format!("--rw={rw}"),
            format!("--bs={}", a.record_bytes),
            format!("--size={bytes}"),
            "--ioengine=psync".into(),
            "--end_fsync=1".into(),
            "--invalidate=1".into(),
            "--output-format=json".into(),
        ])
        .output()
        .with_context(|| format!("running {} (apt-get install fio)", a.fio.display()))?;
    ensure!(out.status.success(), "fio {rw} failed: {}", String::from_utf8_lossy(&out.stderr));
    let elapsed = started.elapsed().as_secs_f64();
    let v: Value = serde_json::from_slice(&out.stdout).context("fio's JSON output")?;
    let io = v["jobs"][0][rw]["io_bytes"].as_u64().context("fio reported no I/O")?;
    ensure!(io == bytes, "fio moved {io} bytes, not {bytes}");
    Ok(bytes as f64 / elapsed / 1e9)
}
