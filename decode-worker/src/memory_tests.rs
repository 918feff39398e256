//! Start-up memory refusals through `run`, without a GPU: `--gpu-memory` stands in for
//! the device's memory, and the plan is checked before the KV pool is allocated or the
//! device opened.

use clap::Parser;
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::*;

/// `run` with these arguments; shut down as soon as it serves (a GPU machine gets that far).
async fn start(model: &std::path::Path, extra: &[&str]) -> Result<(), WorkerError> {
    let mut args = vec!["decode-worker", "--model", model.to_str().unwrap(), "--metrics-listen", "off"];
    args.extend_from_slice(extra);
    let cfg = DecodeConfig::try_parse_from(args).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    stop.cancel();
    run(cfg, listener, None, stop).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_kv_pool_that_does_not_fit_and_names_the_pages_that_do() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    write_checkpoint(&model, &InitOptions::new(Preset::Tiny, 1, WeightDtype::Fp8)).unwrap();
    let args = ["--device", "cuda:0", "--gpu-memory", "2GB", "--max-pages", "10000000", "--max-batch", "8"];
    let err = start(&model, &args).await.expect_err("a 10M-page pool does not fit in 2 GB").to_string();
    assert!(err.contains("does not fit cuda:0") && err.contains("10000000 KV pages"), "{err}");
    let pages: usize = err
        .split("Lower --max-pages to ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no page count in {err}"));
    assert!(pages > 1000 && pages < 10_000_000, "{err}");
    // A pool that fits gets past the plan (and fails only at opening the GPU this
    // machine may not have).
    let args = ["--device", "cuda:0", "--gpu-memory", "2GB", "--max-pages", "64", "--max-batch", "8"];
    match start(&model, &args).await {
        Ok(()) => {}
        Err(e) => assert!(!e.to_string().contains("does not fit"), "{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_needs_a_gpu_device() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    write_checkpoint(&model, &InitOptions::new(Preset::Tiny, 1, WeightDtype::Bf16)).unwrap();
    let err = start(&model, &["--gpu-memory", "2GB"]).await.expect_err("cpu").to_string();
    assert!(err.contains("--gpu-memory plans GPU memory; it needs --device cuda:N"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_direct_on_needs_a_gpu_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    write_checkpoint(&model, &InitOptions::new(Preset::Tiny, 1, WeightDtype::Bf16)).unwrap();
    let err = start(&model, &["--gpu-direct", "on"]).await.expect_err("a CPU engine").to_string();
    assert!(err.contains("--gpu-direct on needs a GPU engine"), "{err}");
    // `auto` on the CPU is the registered host memory it always was.
    start(&model, &["--gpu-direct", "auto"]).await.expect("a CPU worker with --gpu-direct auto");
}
