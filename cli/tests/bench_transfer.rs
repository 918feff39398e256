//! `sluice bench transfer` as a user runs it: a sender and a receiver process, real puts
//! over tcp, and a JSON report whose byte counts follow from the `small` preset's page
//! size. The ucx_perftest column is checked when ucx_perftest is installed.

use std::process::Command;

use engine::EntryDtype;
use engine::config::ModelConfig;
use engine::init::Preset;

#[test]
fn bench_transfer_reports_gbps_and_page_bytes() {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "transfer", "--pages", "64", "--iters", "2", "--tls", "tcp", "--json"])
        .env("RUST_LOG", "error")
        .output()
        .expect("run sluice");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "sluice bench transfer failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON report on stdout");

    let cfg = ModelConfig::from_json_str(&Preset::Small.config_json().to_string()).unwrap();
    let page = cfg.kv_layout(EntryDtype::Bf16).page_bytes() as u64;
    assert_eq!(v["page_bytes"].as_u64(), Some(page));
    assert_eq!(v["pages"].as_u64(), Some(64));
    assert_eq!(v["pages_bytes_per_iter"].as_u64(), Some(64 * page));
    let state = v["state_bytes_per_iter"].as_u64().unwrap();
    assert!(state > 0);

    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "one row per --tls");
    let row = &rows[0];
    assert_eq!(row["tls"], "tcp");
    assert_eq!(row["message_bytes"].as_u64(), Some(page), "one put per page");
    assert_eq!(row["bytes_per_iter"].as_u64(), Some(64 * page + state), "every page, then the state slot");
    assert_eq!(row["sluice_seconds"].as_array().unwrap().len(), 2);
    let sluice = row["sluice_gbps"].as_f64().unwrap();
    assert!(sluice > 0.0, "{row}");
    assert_eq!(row["ucx_perftest_messages"].as_u64(), Some(2 * 64));

    match (row["ucx_perftest_gbps"].as_f64(), row["ucx_perftest_error"].as_str()) {
        (Some(peer), None) => {
            assert!(peer > 0.0, "{row}");
            assert!((row["ratio"].as_f64().unwrap() - sluice / peer).abs() < 1e-9, "{row}");
        }
        (None, None) => eprintln!("ucx_perftest is not installed (Debian: ucx-utils); its column is not checked"),
        (_, Some(e)) => panic!("ucx_perftest failed: {e}"),
    }
}
