//! RMA between two processes. This binary runs as the sender (parent) and re-executes
//! itself with `UCX_SYS_TEST_ROLE=receiver` as the receiver (child):
//!
//! 1. The receiver allocates a 1 MiB region and prints `READY <address> <base> <rkey>`
//!    (hex) on stdout, then progresses its worker, sleeping on the event fd, until it
//!    reads `done` on stdin; then it checks the pattern and exits 0 (1 on mismatch).
//! 2. The parent connects, puts the pattern in several puts at different offsets,
//!    flushes, reads a slice back with a get, closes, writes `done` and expects exit 0.
//!
//! Run once per UCX_TLS value, set identically for both processes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{TIMEOUT, hex, pattern, unhex};
use ucx_sys::{Context, ErrorMode, Features, MemRegion, Worker};

const ROLE_VAR: &str = "UCX_SYS_TEST_ROLE";
const REGION: usize = 1 << 20;
const SEED: u8 = 0x5a;
/// `shm` alone is enough on one host (no `self` needed): the sender maps the receiver's
/// posix segment. But in UCX 1.13 no shared-memory transport supports peer-failure
/// detection, so `ErrorMode::Peer` endpoints are unreachable over `shm`, `sm` or
/// `shm,self`; `shm,tcp` connects with Peer but then carries everything over tcp.
/// Shared memory therefore runs with `ErrorMode::None`.
const TLS_VALUES: [(&str, ErrorMode); 2] = [("shm", ErrorMode::None), ("tcp", ErrorMode::Peer)];
/// Space-separated `UCX_TLS[:none]` values to run instead of [`TLS_VALUES`], e.g.
/// "rc,sm tcp sm:none" (`:none` selects `ErrorMode::None`).
const TLS_OVERRIDE_VAR: &str = "UCX_SYS_TEST_TLS";

fn main() -> ExitCode {
    if std::env::var(ROLE_VAR).as_deref() == Ok("receiver") {
        return match receiver() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("receiver: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if std::env::args().any(|a| a == "--list") {
        return ExitCode::SUCCESS;
    }
    let override_list = std::env::var(TLS_OVERRIDE_VAR).ok();
    let tls_values: Vec<(&str, ErrorMode)> = match &override_list {
        Some(list) => list
            .split_whitespace()
            .map(|v| v.strip_suffix(":none").map_or((v, ErrorMode::Peer), |tls| (tls, ErrorMode::None)))
            .collect(),
        None => TLS_VALUES.to_vec(),
    };
    println!("\nrunning {} tests", tls_values.len());
    let mut failed = 0;
    for &(tls, mode) in &tls_values {
        let name = format!("two_process::put_1mib_with_ucx_tls_{tls}_error_mode_{mode:?}");
        match sender(tls, mode) {
            Ok(()) => println!("test {name} ... ok"),
            Err(e) => {
                println!("test {name} ... FAILED\n    {e}");
                failed += 1;
            }
        }
    }
    println!(
        "\ntest result: {}. {} passed; {failed} failed\n",
        if failed == 0 { "ok" } else { "FAILED" },
        tls_values.len() - failed
    );
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// Kills the child on every early return.
struct Receiver(Child);

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn sender(tls: &str, mode: ErrorMode) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let child = Command::new(exe)
        .env(ROLE_VAR, "receiver")
        .env("UCX_TLS", tls)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn receiver: {e}"))?;
    let mut child = Receiver(child);

    let stdout = child.0.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(TIMEOUT).map_err(|_| "receiver printed nothing in time".to_string())?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [ready, address, base, rkey] = fields[..] else {
        return Err(format!("unexpected receiver line {line:?}"));
    };
    if ready != "READY" {
        return Err(format!("unexpected receiver line {line:?}"));
    }
    let address = unhex(address)?;
    let base = u64::from_str_radix(base, 16).map_err(|e| format!("base: {e}"))?;
    let rkey = unhex(rkey)?;

    let ctx = Context::with_config(Features::RMA | Features::WAKEUP, &[("TLS", tls)]).map_err(|e| e.to_string())?;
    let worker = Worker::new(&ctx).map_err(|e| e.to_string())?;
    let ep = worker.connect_with(&address, mode).map_err(|e| e.to_string())?;
    let rkey = ep.unpack_rkey(&rkey).map_err(|e| e.to_string())?;
    if (rkey.base(), rkey.len()) != (base, REGION as u64) {
        return Err(format!("rkey describes {:#x}+{}, receiver said {base:#x}+{REGION}", rkey.base(), rkey.len()));
    }

    // Uneven pieces, issued last to first.
    let data = pattern(REGION, SEED);
    let cuts = [0, 1, 4096, 4099, 70_000, 131_072, 500_000, 777_777, REGION];
    let puts: Vec<(&[u8], u64)> = cuts.windows(2).rev().map(|w| (&data[w[0]..w[1]], base + w[0] as u64)).collect();
    worker.put_all(&ep, &puts, &rkey, TIMEOUT).map_err(|e| format!("put_all: {e}"))?;

    let mut back = vec![0u8; 10_000];
    worker.get_blocking(&ep, &mut back, base + 123_456, &rkey, TIMEOUT).map_err(|e| format!("get: {e}"))?;
    if back[..] != data[123_456..133_456] {
        return Err("get returned different bytes than were put".into());
    }
    drop(rkey);
    ep.close(TIMEOUT).map_err(|e| format!("close: {e}"))?;

    let mut stdin = child.0.stdin.take().expect("piped stdin");
    writeln!(stdin, "done").map_err(|e| format!("write done: {e}"))?;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match child.0.try_wait().map_err(|e| format!("wait: {e}"))? {
            Some(status) if status.success() => return Ok(()),
            Some(status) => return Err(format!("receiver exited with {status}")),
            None if Instant::now() > deadline => return Err("receiver did not exit in time".into()),
            None => thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn receiver() -> Result<(), String> {
    // UCX_TLS comes from the environment the parent set.
    let ctx = Context::new(Features::RMA | Features::WAKEUP).map_err(|e| e.to_string())?;
    let worker = Worker::new(&ctx).map_err(|e| e.to_string())?;
    let region = MemRegion::allocate(&ctx, REGION).map_err(|e| e.to_string())?;
    let address = worker.address().map_err(|e| e.to_string())?;
    let rkey = region.pack_rkey().map_err(|e| e.to_string())?;
    println!("READY {} {:x} {}", hex(&address), region.address(), hex(&rkey));
    std::io::stdout().flush().map_err(|e| e.to_string())?;

    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let _ = tx.send(line);
    });
    let deadline = Instant::now() + 2 * TIMEOUT;
    let line = loop {
        if let Ok(line) = rx.try_recv() {
            break line;
        }
        if Instant::now() > deadline {
            return Err("no `done` from the sender in time".into());
        }
        while worker.progress() > 0 {}
        worker.wait_for_events(Duration::from_millis(50)).map_err(|e| e.to_string())?;
    };
    if line.trim() != "done" {
        return Err(format!("expected `done` on stdin, got {line:?}"));
    }

    let mut got = vec![0u8; REGION];
    // SAFETY: the sender flushed all puts and closed its endpoint before writing `done`.
    unsafe { region.read_at(0, &mut got) };
    let expected = pattern(REGION, SEED);
    match got.iter().zip(&expected).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!("region differs from the pattern at offset {i}: {} != {}", got[i], expected[i])),
    }
}
