//! `sluice up --tls --once`: a local cluster with a throwaway CA, every service serving TLS
//! and dialing its peers with mutual TLS, health waits over TLS, and the sample request
//! served to a client that trusts the printed CA. Needs the service binaries next to
//! `sluice` (`cargo build --workspace --bins`).

use std::path::Path;
use std::process::Command;

fn sluice(args: &[&str]) -> std::process::Output {
    // `timeout` bounds the whole run: a cluster that never comes up must not hang the suite.
    Command::new("timeout")
        .arg("180")
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("RUST_LOG", "info,engine=warn")
        .output()
        .expect("run sluice")
}

#[test]
fn up_with_tls_serves_the_sample_request_over_mutual_tls() {
    if cluster::launch::find_binary("router").is_err() {
        panic!("the service binaries are missing: run `cargo build --workspace --bins` first");
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    let o = sluice(&["model", "init", "--preset", "tiny", "--seed", "5", "--out", model.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let logs = dir.path().join("logs");
    let grpc = format!("127.0.0.1:{}", cluster::launch::free_port());
    let http = format!("127.0.0.1:{}", cluster::launch::free_port());
    let o = sluice(&[
        "up",
        "--model",
        model.to_str().unwrap(),
        "--tls",
        "--once",
        "--grpc",
        &grpc,
        "--http",
        &http,
        "--log-dir",
        logs.to_str().unwrap(),
        "--ready-timeout-s",
        "90",
    ]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "sluice up --tls failed:\n{out}\n{err}");
    assert!(out.contains(&format!("gRPC  https://{grpc}")), "{out}");
    assert!(out.contains(&format!("HTTP  https://{http}")), "{out}");
    let ca = logs.join("tls/ca.crt");
    assert!(out.contains(&format!("--tls-ca {}", ca.display())), "{out}");
    assert!(out.contains("generated tokens; time to first token"), "the sample request was served:\n{out}");
    for f in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(logs.join("tls").join(f).is_file(), "{f} written");
    }
    let mode = std::fs::metadata(logs.join("tls/tls.key")).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o077, 0, "the key is the owner's only");
    for service in ["router", "decode-0", "prefill-1", "kvstore"] {
        let log = std::fs::read_to_string(logs.join(format!("{service}.log"))).unwrap_or_default();
        assert!(log.contains("TLS is on"), "{service} did not serve TLS:\n{log}");
    }
    assert!(Path::new(&ca).exists());
}
