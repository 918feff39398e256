//! Workers on GPUs and on several devices: a cluster whose prefill and decode workers
//! compute on CUDA (`--device cuda:0`), or span several devices (`--devices`: data-
//! parallel attention, expert-parallel MoE), their KV staged through registered host
//! mirrors, with a kvstore restoring prefixes into device memory, serves what the CPU
//! engine computes: the same greedy tokens, logprobs within the BF16 tolerance on GPUs.
//! The layout over several devices also runs on CPU "devices", so CI checks it (and
//! the KV contract between workers of different device counts) without GPUs; the GPU
//! tests say they are skipped and pass on machines without enough GPUs.

use std::time::Duration;

use engine::{CpuBackend, Engine, EngineOptions, EntryDtype};
use sluice_e2e::reference::{assert_close, cold};
use sluice_e2e::{KvSpec, Spec, TestCluster, ids_request, prompt};

const VOCAB: u32 = 320;
const MAX_TOKENS: usize = 12;
/// BF16 weights and activations on the GPU against the CPU's f32 compute.
const GPU_LOGPROB_TOL: f32 = 5e-2;
/// CPU devices compute what one CPU computes, up to the order of the MoE's sums.
const CPU_LOGPROB_TOL: f32 = 1e-3;

fn args(flag: &str, value: &str) -> Vec<String> {
    vec![flag.to_string(), value.to_string()]
}

/// Prompts short and long, cold and restored from the kvstore, and one that shares a
/// cached prefix and then differs, each answered as the CPU engine answers it.
async fn serves_what_the_cpu_engine_computes(prefill: Vec<String>, decode: Vec<String>, tol: f32) {
    let spec = Spec {
        prefill_args: vec![prefill],
        decode_args: decode,
        kvstore: Some(KvSpec::policy("periodic:256")),
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let opts = EngineOptions { kv_dtype: EntryDtype::Bf16, max_pages: 64, max_sequences: 2, max_chunk_tokens: 2048 };
    let mut engine = Engine::load(&c.model, CpuBackend::new(), opts).expect("the CPU engine");

    let long = prompt(700, 3, VOCAB);
    let mut diverged = long[..520].to_vec();
    diverged.extend(prompt(90, 4, VOCAB));
    for (what, p) in
        [("short", prompt(5, 1, VOCAB)), ("two blocks", prompt(260, 2, VOCAB)), ("long, cold", long.clone())]
    {
        let got = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect(what);
        assert_close(&got, &cold(&mut engine, &p, MAX_TOKENS), tol, what);
    }
    c.wait_kvstore(5, 2).await;
    // Restored from the kvstore into device memory through the prefill worker's mirror.
    let hit = c.generate(ids_request(long.clone(), MAX_TOKENS as u32)).await.expect("long, cached");
    assert_close(&hit, &cold(&mut engine, &long, MAX_TOKENS), tol, "long, cached");
    assert!(hit.fin.usage.as_ref().unwrap().cached_tokens > 0, "the second long request restores its prefix");
    let got = c.generate(ids_request(diverged.clone(), MAX_TOKENS as u32)).await.expect("diverged");
    assert_close(&got, &cold(&mut engine, &diverged, MAX_TOKENS), tol, "shared prefix, then different");
    c.assert_pages_return(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_on_the_gpu_serves_what_the_cpu_engine_computes() {
    if !kernels::cuda::driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine (the GPU cluster test runs on a GPU machine)");
        return;
    }
    let gpu = args("--device", "cuda:0");
    serves_what_the_cpu_engine_computes(gpu.clone(), gpu, GPU_LOGPROB_TOL).await;
}

/// Prefill on two devices, decode on four: pages and state slots keep one geometry and
/// one wire format whatever the device count on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_over_several_cpu_devices_serve_what_one_device_computes() {
    let prefill = args("--devices", "cpu,cpu");
    let decode = args("--devices", "cpu,cpu,cpu,cpu");
    serves_what_the_cpu_engine_computes(prefill, decode, CPU_LOGPROB_TOL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_spanning_two_gpus_serve_what_the_cpu_engine_computes() {
    let gpus = kernels::cuda::CudaBackend::device_count();
    if gpus < 2 {
        eprintln!("SKIPPED: {gpus} CUDA device(s); workers spanning two GPUs need two (an nvidia-h200-x2 machine)");
        return;
    }
    // The decode worker lists the GPUs the other way round: its device 0 is cuda:1.
    let prefill = args("--devices", "cuda:0,cuda:1");
    let decode = args("--devices", "cuda:1,cuda:0");
    serves_what_the_cpu_engine_computes(prefill, decode, GPU_LOGPROB_TOL).await;
}
