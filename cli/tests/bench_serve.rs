//! `sluice bench serve` against a real local cluster (`sluice up`: kvstore, router, one
//! prefill and one decode worker on the CPU, placed with --prefill-devices /
//! --decode-devices) serving the smallest conformance checkpoint: both workloads, a rate
//! sweep, the JSON's fields, the prefix-cache hit rate, and failures counted by gRPC
//! status. Needs the service binaries next to `sluice` (`cargo build --workspace --bins`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// `sluice up` in the background; stopped with SIGTERM (it then stops its services) when
/// dropped, also when the test fails, and killed if it does not stop in time.
struct Up {
    child: Child,
    stdout: PathBuf,
    logs: PathBuf,
}

impl Up {
    fn start(model: &Path, dir: &Path, grpc: &str, http: &str) -> Up {
        let stdout = dir.join("up.out");
        let logs = dir.join("logs");
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["up", "--model", model.to_str().unwrap(), "--grpc", grpc, "--http", http, "--no-sample"])
            .args(["--log-dir", logs.to_str().unwrap(), "--ready-timeout-s", "90", "--threads-per-worker", "1"])
            .args(["--prefill-devices", "cpu", "--decode-devices", "cpu"])
            .args(["--kvstore-dir", dir.join("kv").to_str().unwrap(), "--kvstore-capacity", "256MiB"])
            .env("RUST_LOG", "info,engine=warn")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(dir.join("up.err")).unwrap())
            .spawn()
            .expect("start sluice up");
        Up { child, stdout, logs }
    }

    /// Wait (bounded) for `sluice up` to say the cluster serves.
    fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if std::fs::read_to_string(&self.stdout).unwrap_or_default().contains("sluice is up") {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("sluice up exited ({status}):\n{}", self.diagnostics());
            }
            assert!(Instant::now() < deadline, "the cluster was not up within {timeout:?}:\n{}", self.diagnostics());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn diagnostics(&self) -> String {
        let mut out = String::new();
        let dir = self.stdout.parent().unwrap();
        for f in [dir.join("up.out"), dir.join("up.err")] {
            out += &format!("--- {}\n{}\n", f.display(), std::fs::read_to_string(&f).unwrap_or_default());
        }
        for entry in std::fs::read_dir(&self.logs).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out +=
                &format!("--- {}\n{}\n", entry.path().display(), tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
        out
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bench(args: &[&str]) -> Output {
    // `timeout` bounds the run whatever happens to the cluster.
    Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve"])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run sluice bench serve")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the --json file")).expect("valid JSON")
}

/// Every request completed and generated exactly what it asked for.
fn assert_all_complete(doc: &Value, per_rate: usize) {
    for run in doc["runs"].as_array().unwrap() {
        let s = &run["summary"];
        assert_eq!((s["completed"].as_u64(), s["failed"].as_u64()), (Some(per_rate as u64), Some(0)), "{s}");
        assert_eq!(s["short"], 0);
        for k in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"] {
            for p in ["mean", "p50", "p90", "p99", "max"] {
                assert!(s[k][p].as_f64().is_some(), "summary.{k}.{p} in {s}");
            }
        }
        assert!(s["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
        let out = s["output_throughput"].as_f64().unwrap();
        assert!(out > 0.0 && s["request_throughput"].as_f64().unwrap() > 0.0);
        assert!((s["output_throughput_per_gpu"].as_f64().unwrap() - out / 2.0).abs() < 1e-9, "--gpus 2");
        let requests = run["requests"].as_array().unwrap();
        assert_eq!(requests.len(), per_rate);
        for r in requests {
            assert_eq!(r["ok"], true, "{r}");
            let asked = r["asked_tokens"].as_u64().unwrap();
            assert_eq!(r["output_tokens"].as_u64(), Some(asked), "{r}");
            assert_eq!(r["usage"]["completion_tokens"].as_u64(), Some(asked), "{r}");
            assert_eq!(r["usage"]["prompt_tokens"], r["prompt_len"], "{r}");
            assert_eq!(r["finish_reason"], "length");
            assert_eq!(r["itl_ms"].as_array().unwrap().len() as u64, asked - 1, "one gap per later token");
        }
    }
}

#[test]
fn bench_serve_measures_both_workloads_through_a_local_cluster() {
    if cluster::launch::find_binary("router").is_err() {
        panic!("the service binaries are missing: run `cargo build --workspace --bins` first");
    }
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/golden/tiny-official/model");
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let grpc = format!("127.0.0.1:{}", cluster::launch::free_port());
    let http = format!("127.0.0.1:{}", cluster::launch::free_port());
    let mut up = Up::start(&model, dir.path(), &grpc, &http);
    up.wait_ready(Duration::from_secs(100));
    let router = format!("http://{grpc}");

    // random: a two-rate sweep, lengths spread around the means.
    let json = dir.path().join("random.json");
    let o = bench(&[
        "--router",
        &router,
        "--model",
        m,
        "--workload",
        "random",
        "--num-prompts",
        "6",
        "--input-len",
        "40",
        "--output-len",
        "5",
        "--range-ratio",
        "0.5",
        "--request-rates",
        "20,inf",
        "--max-concurrency",
        "3",
        "--gpus",
        "2",
        "--timeout-s",
        "60",
        "--seed",
        "3",
        "--json",
        json.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "bench serve failed:\n{stdout}\n{stderr}\n{}", up.diagnostics());
    assert!(stdout.contains("| rate (req/s) |") && stdout.contains("| 20 |") && stdout.contains("| inf |"), "{stdout}");
    let doc = read_json(&json);
    assert_eq!(doc["config"]["workload"]["name"], "random");
    assert_eq!(doc["config"]["vocab"], 160, "from the model's config.json");
    assert_eq!(doc["runs"].as_array().unwrap().len(), 2);
    assert_eq!((doc["runs"][0]["request_rate"].as_f64(), &doc["runs"][1]["request_rate"]), (Some(20.0), &Value::Null));
    assert_all_complete(&doc, 6);
    let lens: Vec<u64> =
        doc["runs"][0]["requests"].as_array().unwrap().iter().map(|r| r["prompt_len"].as_u64().unwrap()).collect();
    assert!(lens.iter().all(|l| (20..=60).contains(l)) && lens.iter().any(|&l| l != 40), "{lens:?}");

    // shared-prefix: 2 groups × 4 prompts of a 256-token (two-block) system prompt; one
    // at a time, so a group's later prompts can find what its earlier ones stored.
    let json = dir.path().join("shared.json");
    let o = bench(&[
        "--router",
        &router,
        "--vocab",
        "160",
        "--workload",
        "shared-prefix",
        "--groups",
        "2",
        "--prompts-per-group",
        "4",
        "--system-len",
        "256",
        "--question-len",
        "16",
        "--output-len",
        "4",
        "--request-rate",
        "2",
        "--max-concurrency",
        "1",
        "--gpus",
        "2",
        "--timeout-s",
        "60",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--json",
        json.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "bench serve failed:\n{stdout}\n{stderr}\n{}", up.diagnostics());
    assert!(stderr.contains("temperature 0.7, top-p 0.9"), "the run says how it samples:\n{stderr}");
    let doc = read_json(&json);
    assert_all_complete(&doc, 8);
    let sampling = &doc["config"]["sampling"];
    assert_eq!(
        (sampling["temperature"].as_f64(), sampling["top_p"].as_f64()),
        (Some(0.7f32 as f64), Some(0.9f32 as f64))
    );
    let s = &doc["runs"][0]["summary"];
    assert!(s["prefix_cache_hit_rate"].as_f64().unwrap() > 0.0, "no prefix hits with the kvstore on: {s}");
    for r in doc["runs"][0]["requests"].as_array().unwrap() {
        let cached = r["usage"]["cached_tokens"].as_u64().unwrap();
        assert!(cached % 128 == 0 && cached <= 256, "only whole blocks of the shared prefix: {r}");
    }
    let cached: u64 = s["total_cached_tokens"].as_u64().unwrap();
    let total: u64 = s["total_input_tokens"].as_u64().unwrap();
    assert_eq!(total, 8 * 272);
    assert!((s["prefix_cache_hit_rate"].as_f64().unwrap() - cached as f64 / total as f64).abs() < 1e-12);

    // Requests the router refuses are counted by status, and a sweep where none
    // completes fails (after writing what it saw).
    let json = dir.path().join("refused.json");
    let o = bench(&[
        "--router",
        &router,
        "--vocab",
        "160",
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "100000",
        "--warmup",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no request completed"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s = &read_json(&json)["runs"][0]["summary"];
    assert_eq!((s["completed"].as_u64(), s["failed"].as_u64()), (Some(0), Some(2)));
    assert_eq!(s["failures"]["InvalidArgument"], 2, "{s}");
    drop(up);

    // No router there: a clear error, quickly.
    let started = Instant::now();
    let o = bench(&["--router", "http://127.0.0.1:1", "--vocab", "160", "--num-prompts", "1"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot connect to the router"));
    assert!(started.elapsed() < Duration::from_secs(30));
}
