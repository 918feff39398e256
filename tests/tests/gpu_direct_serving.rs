//! GPU-direct KV movement between workers (`--gpu-direct`): with a CUDA-enabled libucx
//! (e.g. the libucx-cu13 wheel's `lib/` first on LD_LIBRARY_PATH), a prefill worker on
//! one GPU puts a prompt's KV straight from its device memory into the decode worker's
//! device memory on another GPU (cuda_ipc; the same GPU on a one-GPU machine). The
//! bytes land equal, the commit's checksums summed on each GPU agree, the decode worker
//! holds no host mirror (`sluice_kv_memory_path{path="device"}`), and a cluster with a
//! kvstore (restores staged through the prefill worker's mirror) serves the CPU
//! engine's greedy tokens, a restored prefix included. Also: a decode worker over two
//! GPUs takes KV on either, and `--kvstore-gpu-direct` lets the kvstore reach the
//! prefill worker's GPU memory in place.
//!
//! Skipped, saying why, without a GPU or without CUDA in the loaded libucx. The staged
//! path (Debian's libucx, or `--gpu-direct off`) is what every other end-to-end test
//! runs, in CI too.

use std::time::Duration;

use engine::{CpuBackend, Engine, EngineOptions, EntryDtype};
use sluice_e2e::reference::{assert_close, cold};
use sluice_e2e::{KvSpec, Spec, TestCluster, ids_request, prompt};
use sluice_proto::v1 as pb;

const VOCAB: u32 = 320;
const MAX_TOKENS: usize = 12;
/// BF16 weights and activations on the GPU against the CPU's f32 compute.
const GPU_LOGPROB_TOL: f32 = 5e-2;

/// The GPUs of the prefill and the decode worker, or `None` (printed why).
fn gpus() -> Option<(usize, usize)> {
    if !kernels::cuda::driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine (GPU-direct runs on a GPU machine)");
        return None;
    }
    let rx = transfer::Receiver::start().expect("a UCX context");
    if !rx.supports_cuda() {
        eprintln!("SKIPPED: {} (put a CUDA-enabled libucx first on LD_LIBRARY_PATH)", rx.describe_library());
        return None;
    }
    let n = kernels::cuda::CudaBackend::device_count();
    let decode = if n >= 2 { 1 } else { 0 };
    eprintln!("prefill on cuda:0, decode on cuda:{decode} ({n} GPU(s))");
    Some((0, decode))
}

/// A GPU worker's flags; split activations, since these answers are compared with the
/// CPU engine's at f32 distance (docs/cuda.md "Activation precision").
fn worker(gpu: usize) -> Vec<String> {
    ["--device", &format!("cuda:{gpu}"), "--gpu-direct", "on", "--activations", "split"].map(String::from).to_vec()
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompts_kv_lands_byte_equal_in_the_decode_gpus_memory() {
    let Some((p, d)) = gpus() else { return };
    lands_byte_equal(worker(p), worker(d)).await;
}

/// A decode worker over two GPUs: its reservations alternate between them, so prompts
/// land on both, each in its own GPU's pages and state slot, and its logits in that
/// slot's window of the one host logits region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_over_two_gpus_takes_gpu_direct_kv_on_either() {
    let Some((p, _)) = gpus() else { return };
    if kernels::cuda::CudaBackend::device_count() < 2 {
        eprintln!("SKIPPED: a decode worker over two GPUs needs two GPUs");
        return;
    }
    let decode =
        ["--devices", "cuda:0,cuda:1", "--gpu-direct", "on", "--activations", "split"].map(String::from).to_vec();
    lands_byte_equal(worker(p), decode).await;
}

/// Reserves four prompts at once (on a decode worker over several GPUs they spread
/// over them), prefills each with GPU-direct sends, and compares what the prefill
/// worker sent with what landed, byte for byte.
async fn lands_byte_equal(prefill_args: Vec<String>, decode_args: Vec<String>) {
    let spec = Spec { debug_hooks: true, prefill_args: vec![prefill_args], decode_args, ..Spec::new(1, 1) };
    let c = TestCluster::start(spec).await;
    let decode_metrics = c.scrape("decode-0").await;
    assert_eq!(metric(&decode_metrics, r#"sluice_kv_memory_path{path="device"}"#), Some(1.0), "no host mirror");
    let prefill_metrics = c.scrape("prefill-0").await;
    assert_eq!(metric(&prefill_metrics, r#"sluice_kv_memory_path{path="device"}"#), Some(1.0), "sends from the GPU");
    let mut decode = c.decode_client("decode-0").await;
    let mut prefill = c.prefill_client("prefill-0").await;
    let lens = [5usize, 128, 300, 1000];
    let mut reserved = Vec::new();
    for len in lens {
        let reserve = pb::ReserveRequest {
            request_id: format!("gpu-direct-{len}"),
            prompt_tokens: len as u32,
            max_tokens: 4,
            fingerprint: String::new(),
        };
        reserved.push(decode.reserve(reserve).await.expect("reserve").into_inner());
    }
    for (i, (len, res)) in lens.into_iter().zip(&reserved).enumerate() {
        let tokens = prompt(len, 21 + i as u32, VOCAB);
        let req = pb::PrefillRequest {
            request_id: format!("gpu-direct-{len}"),
            reservation_id: res.reservation_id.clone(),
            tokens,
            target: res.target.clone(),
            decode_addr: c.worker_url("decode-0"),
            lease_ms: res.lease_ms,
        };
        // The decode worker accepted the commit: the checksums it summed on its GPU
        // equal those the prefill worker summed on its own.
        let reply = prefill.prefill(req).await.unwrap_or_else(|e| panic!("{len} tokens: {e}")).into_inner();
        let key = pb::DumpKvRequest { reservation_id: res.reservation_id.clone() };
        let sent = prefill.dump_kv(key.clone()).await.expect("prefill dump").into_inner();
        let landed = decode.dump_kv(key).await.expect("decode dump").into_inner();
        assert_eq!(sent.pages.len(), len.div_ceil(128));
        assert!(sent.pages.iter().all(|p| p.iter().any(|&b| b != 0)), "every sent page holds KV");
        for (b, (s, l)) in sent.pages.iter().zip(&landed.pages).enumerate() {
            assert!(s == l, "{len} tokens: page {b} differs after a GPU-to-GPU transfer");
        }
        assert!(sent.rings == landed.rings && sent.comp == landed.comp, "{len} tokens: state slot differs");
        assert!(sent.logits == landed.logits, "{len} tokens: logits differ");
        eprintln!("{len} tokens: {} bytes GPU to GPU in {:.3} ms, byte-equal", reply.transfer_bytes, reply.transfer_ms);
    }
    for res in reserved {
        decode.release(pb::ReleaseRequest { reservation_id: res.reservation_id, writer_done: true }).await.unwrap();
    }
    c.assert_pages_return(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_direct_cluster_serves_what_the_cpu_engine_computes() {
    let Some((p, d)) = gpus() else { return };
    let spec = Spec {
        prefill_args: vec![worker(p)],
        decode_args: worker(d),
        kvstore: Some(KvSpec::policy("periodic:256")),
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let decode_metrics = c.scrape("decode-0").await;
    assert_eq!(metric(&decode_metrics, r#"sluice_kv_memory_path{path="device"}"#), Some(1.0));
    let prefill_metrics = c.scrape("prefill-0").await;
    assert_eq!(
        metric(&prefill_metrics, r#"sluice_kv_memory_path{path="device_send"}"#),
        Some(1.0),
        "sends from the GPU, kvstore traffic through the mirror"
    );
    let opts = EngineOptions { kv_dtype: EntryDtype::Bf16, max_pages: 64, max_sequences: 2, max_chunk_tokens: 2048 };
    let mut engine = Engine::load(&c.model, CpuBackend::new(), opts).expect("the CPU engine");
    let long = prompt(700, 3, VOCAB);
    for (what, p) in [("short", prompt(5, 1, VOCAB)), ("long, cold", long.clone())] {
        let got = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect(what);
        assert_close(&got, &cold(&mut engine, &p, MAX_TOKENS), GPU_LOGPROB_TOL, what);
    }
    c.wait_kvstore(5, 2).await;
    let hit = c.generate(ids_request(long.clone(), MAX_TOKENS as u32)).await.expect("long, cached");
    assert_close(&hit, &cold(&mut engine, &long, MAX_TOKENS), GPU_LOGPROB_TOL, "long, cached");
    assert!(hit.fin.usage.as_ref().unwrap().cached_tokens > 0, "the second long request restores its prefix");
    c.assert_pages_return(Duration::from_secs(5)).await;
}

/// `--kvstore-gpu-direct`: the kvstore writes restored pages straight into the prefill
/// worker's GPU memory and reads stored pages from it, with no host mirror on the
/// prefill worker either. The cluster still serves the CPU engine's tokens, a restored
/// prefix included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kvstore_reaches_the_prefill_gpus_memory_in_place() {
    let Some((p, d)) = gpus() else { return };
    let mut prefill = worker(p);
    prefill.push("--kvstore-gpu-direct".into());
    let spec = Spec {
        prefill_args: vec![prefill],
        decode_args: worker(d),
        kvstore: Some(KvSpec::policy("periodic:256")),
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let prefill_metrics = c.scrape("prefill-0").await;
    assert_eq!(
        metric(&prefill_metrics, r#"sluice_kv_memory_path{path="device"}"#),
        Some(1.0),
        "no host mirror on the prefill worker"
    );
    let opts = EngineOptions { kv_dtype: EntryDtype::Bf16, max_pages: 64, max_sequences: 2, max_chunk_tokens: 2048 };
    let mut engine = Engine::load(&c.model, CpuBackend::new(), opts).expect("the CPU engine");
    let long = prompt(700, 5, VOCAB);
    let cold_run = c.generate(ids_request(long.clone(), MAX_TOKENS as u32)).await.expect("cold");
    let expected = cold(&mut engine, &long, MAX_TOKENS);
    assert_close(&cold_run, &expected, GPU_LOGPROB_TOL, "cold");
    c.wait_kvstore(5, 2).await;
    let hit = c.generate(ids_request(long.clone(), MAX_TOKENS as u32)).await.expect("cached");
    assert_close(&hit, &expected, GPU_LOGPROB_TOL, "restored from the kvstore into GPU memory");
    assert!(hit.fin.usage.as_ref().unwrap().cached_tokens > 0, "the second request restores its prefix");
    c.assert_pages_return(Duration::from_secs(5)).await;
}
