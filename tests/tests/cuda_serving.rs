//! Workers on the GPU (`--device cuda:0`): a cluster whose prefill and decode workers
//! compute on CUDA, their KV staged through registered host mirrors, with a kvstore
//! restoring prefixes into GPU memory, serves what the CPU engine computes: the same
//! greedy tokens, logprobs within the BF16 tolerance. Without a CUDA driver the test
//! says it is skipped and passes.

use std::time::Duration;

use engine::generate::{GenerateRequest, Generation, generate};
use engine::sampling::SamplingParams;
use engine::{CpuBackend, Engine, EngineOptions, EntryDtype};
use sluice_e2e::{Generated, KvSpec, Spec, TestCluster, ids_request, prompt};

const VOCAB: u32 = 320;
const MAX_TOKENS: usize = 12;
/// BF16 weights and activations on the GPU against the CPU's f32 compute.
const LOGPROB_TOL: f32 = 5e-2;

fn cold(engine: &mut Engine<CpuBackend>, p: &[u32]) -> Generation {
    let req = GenerateRequest {
        prompt: p.to_vec(),
        max_tokens: MAX_TOKENS,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
    };
    tokio::task::block_in_place(|| generate(engine, &req, |_| {})).expect("in-process generation")
}

fn assert_close(got: &Generated, want: &Generation, what: &str) {
    let ids: Vec<u32> = want.tokens.iter().map(|s| s.token).collect();
    assert_eq!(got.ids(), ids, "{what}: greedy tokens differ from the CPU engine");
    for (i, (g, w)) in got.logprobs().iter().zip(want.tokens.iter().map(|s| s.logprob)).enumerate() {
        assert!((g - w).abs() <= LOGPROB_TOL, "{what}: logprob {i} is {g}, the CPU engine's {w}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_on_the_gpu_serves_what_the_cpu_engine_computes() {
    if !kernels::cuda::driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine (the GPU cluster test runs on a GPU machine)");
        return;
    }
    let gpu = vec!["--device".to_string(), "cuda:0".to_string()];
    let spec = Spec {
        prefill_args: vec![gpu.clone()],
        decode_args: gpu,
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
        assert_close(&got, &cold(&mut engine, &p), what);
    }
    c.wait_kvstore(5, 2).await;
    // Restored from the kvstore into GPU memory through the prefill worker's mirror.
    let hit = c.generate(ids_request(long.clone(), MAX_TOKENS as u32)).await.expect("long, cached");
    assert_close(&hit, &cold(&mut engine, &long), "long, cached");
    assert!(hit.fin.usage.as_ref().unwrap().cached_tokens > 0, "the second long request restores its prefix");
    let got = c.generate(ids_request(diverged.clone(), MAX_TOKENS as u32)).await.expect("diverged");
    assert_close(&got, &cold(&mut engine, &diverged), "shared prefix, then different");
    c.assert_pages_return(Duration::from_secs(5)).await;
}
