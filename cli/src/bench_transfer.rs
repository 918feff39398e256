//! `sluice bench transfer`: how fast our KV [`Sender`] moves pages of the `small` preset
//! into another process's registered pool, next to `ucx_perftest -t ucp_put_bw` on the
//! same transport and message size, in the same run.
//!
//! For each `UCX_TLS` value this process re-executes itself twice, both children with
//! that `UCX_TLS`: a receiver, which holds the pool as a decode worker does
//! ([`Receiver`]: registered regions, progress thread) and prints the [`Target`] a
//! prefill worker would be handed, and a sender, which writes every page into it with
//! [`Sender::send`] as a prefill worker does (a put per page, or per run of GPU pages
//! that continue one another, plus the state slot and logits, all flushed once: a
//! returned send means the bytes are in the receiver's memory). UCX reads `UCX_TLS` when a context is created, so a fresh pair of processes
//! per row is how each row gets its transport, just as ucx_perftest is run. At the end
//! the receiver checksums what landed and the row fails on any difference.
//!
//! The children talk in lines: the receiver prints `TARGET <hex KvTarget proto>`; this
//! process hands that line to the sender, which prints `RESULT <json>` when done; then
//! `done` on the receiver's stdin makes it print `LANDED <json checksums>` and exit.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::{Args, ValueEnum};
use cluster::launch::free_port;
use engine::config::ModelConfig;
use engine::init::Preset;
use engine::{CpuBackend, EntryDtype, Fingerprint};
use kernels::backend::Backend;
use prost::Message;
use serde_json::{Value, json};
use sluice_proto::v1 as pb;
use transfer::{Checksums, Receiver, RegisteredRegion, SendParts, Sender, Target, WireGeometry};

use crate::args;
use crate::child_proc::{Proc, expect_line, read_lines};

/// Page bytes per iteration when `--pages` is not given: far more than the caches hold
/// (both the source and the destination are this large), and long enough to time.
const DEFAULT_BYTES: usize = 256 << 20;
/// Pause between ucx_perftest client attempts while its server is not listening yet.
const PERFTEST_RETRY: Duration = Duration::from_millis(100);

#[derive(Args)]
pub struct TransferArgs {
    /// `UCX_TLS` of one row; repeat for more rows (a value may itself be a list, e.g.
    /// `posix,cma`). Default: `shm` and `tcp`; with --devices, `shm,cuda_ipc,cuda_copy`.
    #[arg(long = "tls")]
    tls: Vec<String>,
    /// Whose KV geometry the pages have: the `small` preset, or V4-Flash at real widths.
    #[arg(long, default_value = "small")]
    preset: GeometryPreset,
    /// Move pages GPU to GPU: the sender's and the receiver's device, e.g.
    /// `cuda:0,cuda:1` (the same GPU twice is allowed). Pages then live in device memory
    /// on both sides, as between GPU-direct workers (needs a CUDA-enabled libucx), and a
    /// peer copy of the same bytes joins the comparison.
    #[arg(long)]
    devices: Option<String>,
    /// Pages moved per iteration (default: enough for 256 MiB).
    #[arg(long, conflicts_with = "tokens")]
    pages: Option<usize>,
    /// Prompt tokens per iteration instead of --pages (one page per 128 tokens).
    #[arg(long)]
    tokens: Option<usize>,
    /// Timed iterations; each moves every page once.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed iterations first (connection set-up, first touch of the memory).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// KV entry storage, which sets the page size (bf16 is what the workers use).
    #[arg(long, default_value = "bf16", value_parser = args::kv_dtype)]
    kv_dtype: EntryDtype,
    /// The ucx_perftest binary to compare with.
    #[arg(long, default_value = "ucx_perftest")]
    perftest: PathBuf,
    /// Longest wait for any one step: a child's reply, one iteration, one ucx_perftest
    /// run (seconds).
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// Reserve the receiver's pages in reverse order, so that no page continues the one
    /// before it on both ends and every page is a put of its own (a fragmented decode
    /// pool); by default pages are one ascending run on both ends, and GPU pages go out
    /// as one put.
    #[arg(long)]
    scatter: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Run as one of the two child processes (internal).
    #[arg(long, hide = true)]
    role: Option<Role>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Role {
    Receiver,
    Sender,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum GeometryPreset {
    Small,
    Flash,
}

impl GeometryPreset {
    fn preset(self) -> Preset {
        match self {
            GeometryPreset::Small => Preset::Small,
            GeometryPreset::Flash => Preset::Flash,
        }
    }

    fn name(self) -> &'static str {
        match self {
            GeometryPreset::Small => "small",
            GeometryPreset::Flash => "flash",
        }
    }
}

/// A preset's KV geometry, derived from its config as the workers derive it from the
/// model. No checkpoint is written, so there is no real fingerprint; the compatibility
/// check only needs both sides to use the same one.
fn geometry(preset: GeometryPreset, dtype: EntryDtype) -> Result<WireGeometry> {
    let cfg = ModelConfig::from_json_str(&preset.preset().config_json().to_string())?;
    Ok(WireGeometry::new(&cfg.kv_layout(dtype), &Fingerprint([0x5b; 32]), cfg.vocab_size))
}

/// `cuda:S,cuda:R` as (sender, receiver) ordinals.
fn parse_devices(s: &str) -> Result<(usize, usize)> {
    let d = engine::device::parse_devices(s).map_err(|e| anyhow!("--devices {e}"))?;
    match d.as_slice() {
        [engine::Device::Cuda(a), engine::Device::Cuda(b)] => Ok((*a, *b)),
        [engine::Device::Cuda(a)] => Ok((*a, *a)),
        _ => bail!("--devices takes the sender's and the receiver's GPU, e.g. cuda:0,cuda:1"),
    }
}

pub fn run(a: TransferArgs) -> Result<()> {
    let g = geometry(a.preset, a.kv_dtype)?;
    // The same GPU for both sides is written `cuda:0` (a list may not repeat a GPU).
    let devices = a.devices.as_deref().map(parse_devices).transpose()?;
    let pages = match (a.pages, a.tokens) {
        (Some(p), _) => p,
        (None, Some(t)) => t.div_ceil(g.block),
        (None, None) => DEFAULT_BYTES.div_ceil(g.page_bytes),
    };
    ensure!(pages > 0, "--pages must be at least 1");
    ensure!(a.iters > 0, "--iters must be at least 1");
    let step = Duration::from_secs(a.timeout_s.max(1));
    // Bounds the whole of one sender run: set-up plus every iteration.
    let run_bound = step * (a.iters + a.warmup + 2) as u32;
    match (a.role, devices) {
        (Some(Role::Receiver), None) => receiver(&g, pages, a.scatter, run_bound),
        (Some(Role::Sender), None) => sender(&g, a.iters, a.warmup, step),
        #[cfg(feature = "cuda")]
        (Some(Role::Receiver), Some((_, to))) => {
            crate::bench_transfer_gpu::receiver(&g, pages, a.scatter, to, run_bound)
        }
        #[cfg(feature = "cuda")]
        (Some(Role::Sender), Some((from, _))) => crate::bench_transfer_gpu::sender(&g, from, a.iters, a.warmup, step),
        #[cfg(not(feature = "cuda"))]
        (Some(_), Some(_)) => bail!("--devices needs a build with the `cuda` feature"),
        (None, _) => compare(&a, &g, pages, devices, step, run_bound),
    }
}

// ---- the orchestrating process ----

struct Row {
    tls: String,
    sluice: SluiceRun,
    /// ucx_perftest with page-sized messages.
    perftest: Result<Option<f64>>,
    /// ucx_perftest with messages the size of the sender's mean put, when pages were
    /// merged into larger puts.
    perftest_at_put: Option<Result<Option<f64>>>,
}

/// The tls rows to run: as given, else the defaults for host or device memory.
fn tls_rows(a: &TransferArgs, on_gpus: bool) -> Vec<String> {
    match (a.tls.is_empty(), on_gpus) {
        (false, _) => a.tls.clone(),
        (true, false) => vec!["shm".into(), "tcp".into()],
        (true, true) => vec!["shm,cuda_ipc,cuda_copy".into()],
    }
}

struct SluiceRun {
    bytes_per_iter: u64,
    seconds: Vec<f64>,
    /// Puts of page bytes per iteration (GPU pages that continue one another go as one).
    page_puts: usize,
}

impl SluiceRun {
    fn gbps(&self) -> f64 {
        self.bytes_per_iter as f64 * self.seconds.len() as f64 / self.seconds.iter().sum::<f64>() / 1e9
    }

    /// Mean bytes of one page put, `page_bytes` being every page of an iteration.
    fn mean_put_bytes(&self, page_bytes: usize) -> usize {
        page_bytes.div_ceil(self.page_puts.max(1))
    }
}

fn compare(
    a: &TransferArgs,
    g: &WireGeometry,
    pages: usize,
    devices: Option<(usize, usize)>,
    step: Duration,
    run_bound: Duration,
) -> Result<()> {
    let exe = std::env::current_exe().context("locating the sluice executable")?;
    let mut rows = Vec::new();
    for tls in tls_rows(a, devices.is_some()) {
        eprintln!("UCX_TLS={tls}: sluice sender -> receiver, {pages} pages x {} iterations ...", a.iters + a.warmup);
        let sluice = sluice_run(&exe, a, &tls, pages, step, run_bound)
            .with_context(|| format!("sluice transfer over UCX_TLS={tls}"))?;
        eprintln!("UCX_TLS={tls}: ucx_perftest ...");
        let perf = Perftest { bin: &a.perftest, tls: &tls, devices };
        let perftest = ucx_perftest(&perf, g.page_bytes, pages * a.iters, pages * a.warmup, run_bound);
        let perftest_at_put = (sluice.page_puts < pages).then(|| {
            let size = sluice.mean_put_bytes(pages * g.page_bytes);
            eprintln!("UCX_TLS={tls}: ucx_perftest with {size}-byte messages (the sender's mean put) ...");
            // The same bytes as the page-sized run, at least a few messages.
            let messages = (pages * a.iters * g.page_bytes).div_ceil(size).max(4);
            ucx_perftest(&perf, size, messages, messages.div_ceil(a.iters).max(1), run_bound)
        });
        rows.push(Row { tls, sluice, perftest, perftest_at_put });
    }
    let baseline = match devices {
        None => Baseline::Memcpy(memcpy_gbps(g.page_bytes, pages, a.iters, a.warmup)),
        Some((from, to)) => Baseline::PeerCopy(peer_copy_gbps(from, to, pages * g.page_bytes, g.page_bytes, a.iters)?),
    };
    report(a, g, pages, devices, &rows, baseline);
    Ok(())
}

/// What a row is compared with besides ucx_perftest: a copy of the same pages within
/// one process (host memory) or between the two GPUs (device memory).
#[derive(Clone, Copy)]
enum Baseline {
    Memcpy(f64),
    PeerCopy(f64),
}

impl Baseline {
    fn gbps(self) -> f64 {
        match self {
            Baseline::Memcpy(v) | Baseline::PeerCopy(v) => v,
        }
    }
}

/// GB/s of a device-to-device copy of the same bytes page by page from the sender's GPU
/// to the receiver's (`cuMemcpyPeerAsync`), median of `reps` rounds.
#[cfg(feature = "cuda")]
fn peer_copy_gbps(from: usize, to: usize, bytes: usize, page: usize, reps: usize) -> Result<f64> {
    let a = engine::CudaBackend::new(from).with_context(|| format!("opening cuda:{from}"))?;
    let b = engine::CudaBackend::new(to).with_context(|| format!("opening cuda:{to}"))?;
    Ok(kernels::cuda::peer::peer_copy_gbs(&a, &b, bytes, page, reps))
}

#[cfg(not(feature = "cuda"))]
fn peer_copy_gbps(_: usize, _: usize, _: usize, _: usize, _: usize) -> Result<f64> {
    bail!("--devices needs a build with the `cuda` feature")
}

/// How to run ucx_perftest for a row.
struct Perftest<'a> {
    bin: &'a Path,
    tls: &'a str,
    /// GPU mode: `-m cuda,cuda`, each process on its device (`CUDA_VISIBLE_DEVICES`).
    devices: Option<(usize, usize)>,
}

/// GB/s of copying the same pages page by page within one process. Over shared memory
/// a put is such a copy into the receiver's mapped segment, so this is the most the
/// shm rows can reach with this working set.
fn memcpy_gbps(page_bytes: usize, pages: usize, iters: usize, warmup: usize) -> f64 {
    let src = fill(pages * page_bytes, 9);
    let mut dst = vec![0u8; pages * page_bytes];
    let mut copy = || {
        for (d, s) in dst.chunks_exact_mut(page_bytes).zip(src.chunks_exact(page_bytes)) {
            d.copy_from_slice(s);
        }
    };
    // At least once untimed: the first pass also faults the destination in.
    for _ in 0..warmup.max(1) {
        copy();
    }
    let started = Instant::now();
    for _ in 0..iters {
        copy();
    }
    let elapsed = started.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    (pages * page_bytes * iters) as f64 / elapsed / 1e9
}

fn sluice_run(
    exe: &Path,
    a: &TransferArgs,
    tls: &str,
    pages: usize,
    step: Duration,
    run_bound: Duration,
) -> Result<SluiceRun> {
    let child = |role: &str| {
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "transfer", "--role", role, "--kv-dtype", a.kv_dtype.name()])
            .args(["--preset", a.preset.name()])
            .args(["--pages", &pages.to_string(), "--iters", &a.iters.to_string()])
            .args(["--warmup", &a.warmup.to_string(), "--timeout-s", &a.timeout_s.to_string()])
            .env("UCX_TLS", tls);
        if let Some(d) = &a.devices {
            cmd.args(["--devices", d]);
        }
        if a.scatter {
            cmd.arg("--scatter");
        }
        cmd
    };
    let mut rx = Proc::spawn("receiver", &mut child("receiver"), false).context("starting the receiver")?;
    let target = rx.expect("TARGET", step)?;
    let mut tx = Proc::spawn("sender", &mut child("sender"), false).context("starting the sender")?;
    tx.send(&format!("TARGET {target}"))?;
    let result: Value = serde_json::from_str(&tx.expect("RESULT", run_bound)?).context("sender's RESULT line")?;
    tx.finish_ok(step)?;
    rx.send("done")?;
    let landed: Value = serde_json::from_str(&rx.expect("LANDED", step)?).context("receiver's LANDED line")?;
    rx.finish_ok(step)?;

    let sent = checksums_from_json(&result["checksums"])?;
    if let Some(part) = sent.first_mismatch(&checksums_from_json(&landed)?) {
        bail!("what landed differs from what was sent in {part}");
    }
    let bytes_per_iter = result["bytes_per_iter"].as_u64().ok_or_else(|| anyhow!("RESULT lacks bytes_per_iter"))?;
    let seconds: Vec<f64> = result["seconds"]
        .as_array()
        .ok_or_else(|| anyhow!("RESULT lacks seconds"))?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    ensure!(seconds.len() == a.iters, "RESULT has {} timings for {} iterations", seconds.len(), a.iters);
    let page_puts = result["page_puts"].as_u64().ok_or_else(|| anyhow!("RESULT lacks page_puts"))? as usize;
    Ok(SluiceRun { bytes_per_iter, seconds, page_puts })
}

/// Runs ucx_perftest's put bandwidth test as a server and client pair on loopback:
/// `messages` puts of `size` bytes after `warmup` untimed ones. `Ok(None)` when the
/// binary is not installed. Returns GB/s.
fn ucx_perftest(p: &Perftest<'_>, size: usize, messages: usize, warmup: usize, bound: Duration) -> Result<Option<f64>> {
    let (bin, tls) = (p.bin, p.tls);
    let port = free_port().to_string();
    let mut server_cmd = Command::new(bin);
    server_cmd.args(["-p", &port]).env("UCX_TLS", tls);
    // GPU mode: each side sees only its GPU, so ucx_perftest's own device choice (its
    // rank modulo the GPUs it sees) lands where sluice's receiver and sender are.
    if let Some((from, to)) = p.devices {
        server_cmd.env("CUDA_VISIBLE_DEVICES", to.to_string());
        let _ = from;
    }
    let mut server = match Proc::spawn("ucx_perftest server", &mut server_cmd, true) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        other => other.with_context(|| format!("starting {}", bin.display()))?,
    };
    let deadline = Instant::now() + bound;
    loop {
        let mut cmd = Command::new(bin);
        cmd.args(["127.0.0.1", "-p", &port, "-t", "ucp_put_bw", "-s", &size.to_string()])
            .args(["-n", &messages.to_string(), "-w", &warmup.to_string()])
            // Final numbers only, as CSV.
            .args(["-f", "-v"])
            .env("UCX_TLS", tls);
        if let Some((from, _)) = p.devices {
            cmd.args(["-m", "cuda,cuda"]).env("CUDA_VISIBLE_DEVICES", from.to_string());
        }
        let mut client = Proc::spawn("ucx_perftest client", &mut cmd, true)?;
        let (status, out) = client.finish(deadline.saturating_duration_since(Instant::now()))?;
        if status.success() {
            let _ = server.finish(Duration::from_secs(5));
            return parse_perftest_csv(&out).map(Some);
        }
        // The server's "waiting for connection" goes to a block-buffered pipe, so there
        // is nothing to wait for; the client retries until the port accepts.
        if out.iter().any(|l| l.contains("Connection refused")) && Instant::now() + PERFTEST_RETRY < deadline {
            std::thread::sleep(PERFTEST_RETRY);
            continue;
        }
        let (_, server_out) = server.finish(Duration::from_secs(1)).unwrap_or_default();
        bail!(
            "ucx_perftest client exited with {status}: {}{}",
            out.join(" / "),
            if server_out.is_empty() { String::new() } else { format!("; server: {}", server_out.join(" / ")) }
        );
    }
}

/// Bandwidth from the output of `ucx_perftest -f -v`: a CSV header naming
/// `overall_bw` and one row of numbers. ucx_perftest's "MB/s" are MiB/s (it divides
/// by 1024²); returns GB/s (10⁹ bytes/s).
fn parse_perftest_csv(lines: &[String]) -> Result<f64> {
    let at = lines
        .iter()
        .position(|l| l.split(',').any(|h| h.trim() == "overall_bw"))
        .ok_or_else(|| anyhow!("ucx_perftest printed no CSV header: {}", lines.join(" / ")))?;
    let header: Vec<&str> = lines[at].split(',').map(str::trim).collect();
    let col = header.iter().position(|h| *h == "overall_bw").expect("found above");
    let values: Vec<f64> = lines[at + 1..]
        .iter()
        .find_map(|l| {
            let v: Vec<f64> = l.split(',').map_while(|x| x.trim().parse().ok()).collect();
            (v.len() == header.len()).then_some(v)
        })
        .ok_or_else(|| anyhow!("ucx_perftest printed no result row: {}", lines.join(" / ")))?;
    Ok(values[col] * 1024.0 * 1024.0 / 1e9)
}

fn report(
    a: &TransferArgs,
    g: &WireGeometry,
    pages: usize,
    devices: Option<(usize, usize)>,
    rows: &[Row],
    base: Baseline,
) {
    let memcpy = base.gbps();
    let (base_name, base_key) = match base {
        Baseline::Memcpy(_) => ("memcpy", "memcpy_gbps"),
        Baseline::PeerCopy(_) => ("peer copy", "peer_copy_gbps"),
    };
    let page_total = (pages * g.page_bytes) as u64;
    let state = (g.ring_bytes + g.comp_bytes + g.logits_bytes) as u64;
    let messages = pages * a.iters;
    if a.json {
        let rows: Vec<Value> = rows
            .iter()
            .map(|r| {
                let peer = r.perftest.as_ref().ok().copied().flatten();
                let at_put = r.perftest_at_put.as_ref().and_then(|p| p.as_ref().ok().copied().flatten());
                json!({
                    "tls": r.tls,
                    "message_bytes": g.page_bytes,
                    "pages": pages,
                    "sluice_gbps": r.sluice.gbps(),
                    "sluice_seconds": r.sluice.seconds,
                    "bytes_per_iter": r.sluice.bytes_per_iter,
                    "ucx_perftest_gbps": peer,
                    "ucx_perftest_messages": messages,
                    "ratio": peer.map(|p| r.sluice.gbps() / p),
                    "ratio_to_copy": r.sluice.gbps() / memcpy,
                    "ucx_perftest_error": r.perftest.as_ref().err().map(|e| format!("{e:#}")),
                    "page_puts_per_iter": r.sluice.page_puts,
                    "ucx_perftest_at_put_gbps": at_put,
                    "ucx_perftest_at_put_message_bytes": r.sluice.mean_put_bytes(pages * g.page_bytes),
                    "ratio_at_put": at_put.map(|p| r.sluice.gbps() / p),
                })
            })
            .collect();
        let report = json!({
            "bench": "transfer",
            "preset": a.preset.name(),
            "devices": devices.map(|(f, t)| format!("cuda:{f} -> cuda:{t}")),
            "kv_dtype": a.kv_dtype.name(),
            "page_bytes": g.page_bytes,
            "pages": pages,
            "pages_bytes_per_iter": page_total,
            "state_bytes_per_iter": state,
            "iters": a.iters,
            "warmup": a.warmup,
            "scatter": a.scatter,
            "ucx_perftest": a.perftest.display().to_string(),
            base_key: memcpy,
            "rows": rows,
        });
        println!("{report}");
        return;
    }
    let memory = match devices {
        Some((f, t)) => format!("GPU memory, cuda:{f} -> cuda:{t}"),
        None => "host memory".into(),
    };
    println!(
        "KV transfer, {} geometry ({} entries, {memory}): {pages} pages of {} B = {:.1} MB per iteration (+ {} B of \
         state slot and logits), {} timed iterations after {} warm-up; GB/s = 10^9 B/s",
        a.preset.name(),
        a.kv_dtype.name(),
        g.page_bytes,
        page_total as f64 / 1e6,
        state,
        a.iters,
        a.warmup
    );
    println!(
        "{:<24} {:>13} {:>7} {:>6} {:>12} {:>18} {:>7} {:>18} {:>7} {:>10}",
        "transport",
        "message (B)",
        "pages",
        "puts",
        "sluice GB/s",
        "ucx_perftest GB/s",
        "ratio",
        "perftest @put GB/s",
        "ratio",
        "÷ copy"
    );
    let cells = |p: &Result<Option<f64>>, sluice: f64| match p {
        Ok(Some(p)) => (format!("{p:.2}"), format!("{:.2}", sluice / p)),
        Ok(None) => ("not installed".into(), "-".into()),
        Err(_) => ("failed".into(), "-".into()),
    };
    for r in rows {
        let (peer, ratio) = cells(&r.perftest, r.sluice.gbps());
        let (at_put, ratio_at_put) =
            r.perftest_at_put.as_ref().map_or(("-".into(), "-".into()), |p| cells(p, r.sluice.gbps()));
        let to_copy = r.sluice.gbps() / memcpy;
        println!(
            "{:<24} {:>13} {:>7} {:>6} {:>12.2} {peer:>18} {ratio:>7} {at_put:>18} {ratio_at_put:>7} {to_copy:>10.2}",
            r.tls,
            g.page_bytes,
            pages,
            r.sluice.page_puts,
            r.sluice.gbps()
        );
    }
    for r in rows {
        match &r.perftest {
            Ok(None) => println!(
                "{}: {} not found (Debian: apt-get install ucx-utils); sluice alone",
                r.tls,
                a.perftest.display()
            ),
            Err(e) => println!("{}: ucx_perftest failed: {e:#}", r.tls),
            Ok(Some(_)) => {}
        }
        if let Some(Err(e)) = &r.perftest_at_put {
            println!("{}: ucx_perftest at the sender's put size failed: {e:#}", r.tls);
        }
    }
    println!(
        "puts: page puts per iteration; GPU pages that continue one another on both ends go out as one put (host \
         pages keep a put each; --scatter reverses the receiver's pages so that none continue), and `perftest @put` \
         runs ucx_perftest with messages of the sender's mean put size"
    );
    println!(
        "ucx_perftest: {messages} puts of {} B after {} untimed, `-t ucp_put_bw`; it puts one buffer to one remote \
         address, so its data stays in cache, while sluice writes {pages} distinct pages",
        g.page_bytes,
        pages * a.warmup
    );
    match base {
        Baseline::Memcpy(_) => println!(
            "{base_name} of the same {pages} pages within one process: {memcpy:.2} GB/s (the ceiling for shared memory)"
        ),
        Baseline::PeerCopy(_) => println!(
            "{base_name} (cuMemcpyPeerAsync) of the same {pages} pages GPU to GPU: {memcpy:.2} GB/s (the ceiling for \
             cuda_ipc)"
        ),
    }
}

// ---- the receiver child ----

/// The receiver's page for each page sent: one ascending run, or reversed with
/// `--scatter` (no page then continues the one before it).
pub(crate) fn page_ids(pages: usize, scatter: bool) -> Result<Vec<u32>> {
    let ids: Vec<u32> = (0..pages).map(u32::try_from).collect::<Result<_, _>>().context("too many pages")?;
    Ok(if scatter { ids.into_iter().rev().collect() } else { ids })
}

/// Holds a pool of `pages` pages plus one state slot, prints the target, waits for
/// `done` and prints checksums of what landed, page by page in the order they were
/// sent.
fn receiver(g: &WireGeometry, pages: usize, scatter: bool, bound: Duration) -> Result<()> {
    let rx = Receiver::start()?;
    let pool = rx.allocate(pages * g.page_bytes)?;
    let rings = rx.allocate(g.ring_bytes)?;
    let comp = rx.allocate(g.comp_bytes)?;
    let logits = rx.allocate(g.logits_bytes)?;
    let target = Target {
        geometry: g.clone(),
        ucx_address: rx.address().to_vec(),
        pages: pool.spec.clone(),
        rings: rings.spec.clone(),
        comp: comp.spec.clone(),
        logits: logits.spec.clone(),
        page_ids: page_ids(pages, scatter)?,
        slot: 0,
    };
    println!("TARGET {}", hex(&target.to_proto().encode_to_vec()));
    std::io::stdout().flush()?;

    let stdin = read_lines(std::io::stdin());
    expect_line(&stdin, "bench orchestrator", "done", bound)?;

    // Read what landed the way a decode worker does: through its engine's KV storage.
    let cpu = CpuBackend::new();
    let adopt = |r: RegisteredRegion, bytes: usize, dtype: EntryDtype| {
        cpu.kv_adopt(Box::new(r.region), bytes / dtype.size(), dtype).map_err(|e| anyhow!(e))
    };
    let pool = adopt(pool, pages * g.page_bytes, g.dtype)?;
    let rings = adopt(rings, g.ring_bytes, g.dtype)?;
    let comp = adopt(comp, g.comp_bytes, EntryDtype::F32)?;
    let logits = adopt(logits, g.logits_bytes, EntryDtype::F32)?;
    let host = |kv| cpu.kv_host_bytes(kv).ok_or_else(|| anyhow!("KV memory is not host memory"));
    let pool_bytes = host(&pool)?;
    let landed = SendParts {
        pages: target.page_ids.iter().map(|&id| &pool_bytes[id as usize * g.page_bytes..][..g.page_bytes]).collect(),
        rings: host(&rings)?,
        comp: host(&comp)?,
        logits: host(&logits)?,
    };
    println!("LANDED {}", checksums_json(&Checksums::of(&landed)));
    std::io::stdout().flush()?;
    Ok(())
}

// ---- the sender child ----

/// Reads the target from stdin, sends distinct pages to it `warmup + iters` times and
/// prints the timings of the last `iters` with checksums of what it sent.
fn sender(g: &WireGeometry, iters: usize, warmup: usize, step: Duration) -> Result<()> {
    let stdin = read_lines(std::io::stdin());
    let bytes = unhex(&expect_line(&stdin, "bench orchestrator", "TARGET", step)?)?;
    let target = Target::from_proto(&pb::KvTarget::decode(bytes.as_slice()).context("decoding the target")?)?;
    let pool = fill(target.page_ids.len() * g.page_bytes, 1);
    let (rings, comp, logits) = (fill(g.ring_bytes, 2), fill(g.comp_bytes, 3), fill(g.logits_bytes, 4));
    let parts =
        SendParts { pages: pool.chunks_exact(g.page_bytes).collect(), rings: &rings, comp: &comp, logits: &logits };

    let mut tx = Sender::new()?;
    for _ in 0..warmup {
        tx.send(&target, g, &parts, step)?;
    }
    let mut seconds = Vec::with_capacity(iters);
    let mut puts = 0;
    for _ in 0..iters {
        let started = Instant::now();
        puts = tx.send(&target, g, &parts, step)?.puts;
        seconds.push(started.elapsed().as_secs_f64());
    }
    // Rings, compressor slots and logits are a put each.
    let page_puts = puts.saturating_sub(3);
    let checksums = checksums_json(&Checksums::of(&parts));
    let result =
        json!({"bytes_per_iter": parts.bytes(), "seconds": seconds, "page_puts": page_puts, "checksums": checksums});
    println!("RESULT {result}");
    std::io::stdout().flush()?;
    Ok(())
}

/// `len` bytes of a splitmix64 stream: every page differs, so a page written to the
/// wrong slot changes the checksums.
pub(crate) fn fill(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(len.next_multiple_of(8));
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

pub(crate) fn checksums_json(c: &Checksums) -> Value {
    json!({"pages": c.pages, "rings": c.rings, "comp": c.comp, "logits": c.logits})
}

fn checksums_from_json(v: &Value) -> Result<Checksums> {
    let one = |k: &str| v[k].as_u64().ok_or_else(|| anyhow!("checksums lack `{k}`"));
    let pages = v["pages"].as_array().ok_or_else(|| anyhow!("checksums lack `pages`"))?;
    Ok(Checksums {
        pages: pages.iter().map(|p| p.as_u64().ok_or_else(|| anyhow!("bad page checksum"))).collect::<Result<_>>()?,
        rings: one("rings")?,
        comp: one("comp")?,
        logits: one("logits")?,
    })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Result<Vec<u8>> {
    let s = s.trim();
    ensure!(s.len().is_multiple_of(2), "odd-length hex");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("bad hex")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_bandwidth_from_perftest_csv() {
        let out: Vec<String> = [
            "+----------+",
            "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr",
            "2000,37.494,39.611,39.611,1201.89,1201.89,25246,25246",
        ]
        .map(String::from)
        .to_vec();
        let gbps = parse_perftest_csv(&out).unwrap();
        assert!((gbps - 1201.89 * 1048576.0 / 1e9).abs() < 1e-9, "{gbps}");
        assert!(parse_perftest_csv(&out[..2]).is_err());
    }

    #[test]
    fn small_preset_page_and_hex_round_trip() {
        let g = geometry(GeometryPreset::Small, EntryDtype::Bf16).unwrap();
        // 4 CSA layers (32 entries x (128 + 64 indexer)) + 3 HCA layers (1 x 128), bf16.
        assert_eq!(g.page_bytes, (4 * 32 * (128 + 64) + 3 * 128) * 2);
        let bytes = fill(1001, 7);
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert_ne!(fill(64, 1), fill(64, 2));
    }
}
