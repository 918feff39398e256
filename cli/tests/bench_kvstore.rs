//! `sluice bench kvstore` and `sluice bench prefix` as a user runs them: a real kvstore
//! process (and, for the policy table, whole local clusters) and JSON reports that
//! follow from what was asked.

use std::process::Command;

use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};

#[test]
fn bench_kvstore_moves_every_byte_and_reports_fio_next_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "kvstore", "--total", "16MiB", "--record-bytes", "262144", "--batch", "8", "--json"])
        .arg("--dir")
        .arg(dir.path())
        .env("RUST_LOG", "error")
        .output()
        .expect("run sluice");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "sluice bench kvstore failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON report on stdout");
    assert_eq!(v["records"].as_u64(), Some(64));
    assert_eq!(v["record_bytes"].as_u64(), Some(262_144));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(
        rows.iter().map(|r| r["op"].as_str().unwrap()).collect::<Vec<_>>(),
        ["sequential write", "sequential read"]
    );
    for r in rows {
        let (sluice, fio) = (r["sluice_gbps"].as_f64().unwrap(), r["fio_gbps"].as_f64().unwrap());
        assert!(sluice > 0.0 && fio > 0.0, "{r}");
        assert!((r["ratio"].as_f64().unwrap() - sluice / fio).abs() < 1e-9, "{r}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the benchmark cleans up after itself");
}

#[test]
fn bench_prefix_reports_each_policy() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    write_checkpoint(&model, &InitOptions::new(Preset::Tiny, 5, WeightDtype::Bf16)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "prefix", "--prefix-tokens", "1024", "--suffix-tokens", "16", "--repeat", "1", "--json"])
        .arg("--model")
        .arg(&model)
        .env("RUST_LOG", "error")
        .output()
        .expect("run sluice");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "sluice bench prefix failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON report on stdout");
    let rows = v["rows"].as_array().unwrap();
    let row = |p: &str| rows.iter().find(|r| r["policy"] == p).unwrap_or_else(|| panic!("no {p} row: {v}"));
    let (full, periodic, zero) = (row("full"), row("periodic:1024"), row("zero"));
    let bytes = |r: &serde_json::Value| r["bytes_per_prefix"].as_f64().unwrap();
    let window = |r: &serde_json::Value| r["window_bytes_per_prefix"].as_f64().unwrap();
    // 1024 + 16 tokens: 8 complete blocks; snapshots at all 8 (full), at 8 (periodic), none.
    assert!(bytes(full) > bytes(periodic) && bytes(periodic) > bytes(zero), "{v}");
    assert_eq!(window(zero), 0.0);
    assert!((window(full) / window(periodic) - 8.0).abs() < 1e-9, "{v}");
    for r in [full, periodic, zero] {
        assert_eq!(r["cached_tokens"].as_u64(), Some(1024), "{r}");
        assert!(r["ttft_hit_ms"].as_f64().unwrap() > 0.0 && r["ttft_cold_ms"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(full["recomputed_tokens"].as_f64(), Some(0.0));
    assert_eq!(zero["recomputed_tokens"].as_f64(), Some(512.0), "the tiny preset's 4 windows of 128");
}
