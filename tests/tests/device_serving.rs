//! Workers on GPUs and on several devices: a cluster whose prefill and decode workers
//! compute on CUDA (`--device cuda:0`), or span several devices (`--devices`: data-
//! parallel attention, expert-parallel MoE), their KV staged through registered host
//! mirrors, with a kvstore restoring prefixes into device memory, serves what the CPU
//! engine computes: the same greedy tokens, logprobs within the BF16 tolerance on GPUs.
//! The layout over several devices also runs on CPU "devices", so CI checks it (and
//! the KV contract between workers of different device counts) without GPUs; the GPU
//! tests say they are skipped and pass on machines without enough GPUs. On two H200s a
//! truncated V4-Flash at full widths that fills three quarters of them is served by a
//! prefill and a decode worker each spanning both (`flash_filling_…`).

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

/// A worker's device flag and value, with split activations: these clusters' answers
/// are compared with the CPU engine's at f32 distance (docs/cuda.md "Activation
/// precision"; CPU workers ignore the flag).
fn args(flag: &str, value: &str) -> Vec<String> {
    [flag, value, "--activations", "split"].map(String::from).to_vec()
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

/// A truncated V4-Flash at full widths on an `nvidia-h200-x2`: as many layers as make a
/// prefill and a decode worker, each spanning both GPUs, fill about three quarters of
/// them with weights (each GPU holds half of both workers' routed experts and both
/// workers' other weights), fp8 KV, a kvstore. Requests stream their full token counts;
/// a repeated prompt restores its prefix from the kvstore and gives the first answer's
/// greedy tokens (up to a near-tie in bf16: `same_answer_up_to_a_near_tie`). Prints the layers, the memory plans, the load and every request's
/// TTFT and timings. Needs two GPUs of at least 100 GB and the room in /dev/shm for the
/// checkpoint (`SLUICE_FLASH_MODEL=DIR` serves an existing one, `SLUICE_FLASH_LAYERS=N`
/// chooses the depth); says why it is skipped otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flash_filling_two_h200s_serves_from_workers_spanning_both() {
    let test = "flash_filling_two_h200s_serves_from_workers_spanning_both";
    let gpus = kernels::cuda::CudaBackend::device_count();
    if gpus < 2 {
        eprintln!("SKIPPED {test}: {gpus} CUDA device(s); two workers spanning two H200s need an nvidia-h200-x2");
        return;
    }
    let gpu_bytes = (0..2).map(|o| kernels::cuda::CudaBackend::device_memory(o).unwrap_or(0) as u64).min().unwrap_or(0);
    if gpu_bytes < flash::MIN_GPU_BYTES {
        eprintln!(
            "SKIPPED {test}: the GPUs have {:.0} GB; a Flash filling two GPUs with two workers wants H200s (>= 100 GB each)",
            gpu_bytes as f64 / 1e9
        );
        return;
    }
    let Some(model) = flash::checkpoint(test, gpu_bytes) else { return };
    let mut c = flash::Cluster::start(&model.dir, gpu_bytes).await;

    let vocab = model.vocab;
    let long = prompt(1100, 7, vocab);
    let short = c.generate("short", prompt(5, 5, vocab), 16).await;
    let (long_cold, medium) =
        tokio::join!(c.generate("long, cold", long.clone(), 32), c.generate("medium", prompt(300, 6, vocab), 32));
    // The long prompt's 8 full blocks and the medium one's 2 (and their periodic
    // snapshots) reach the store.
    c.wait_kvstore(10).await;
    let long_hit = c.generate("long, cached", long.clone(), 32).await;
    for g in [&short, &long_cold, &medium, &long_hit] {
        assert_eq!(g.fin.usage.as_ref().map(|u| u.completion_tokens as usize), Some(g.tokens.len()));
    }
    let cached = long_hit.fin.usage.as_ref().map(|u| u.cached_tokens).unwrap_or(0);
    assert!(cached > 0, "the repeated long prompt restores its prefix from the kvstore");
    let (same, worst) = same_answer_up_to_a_near_tie(&long_hit, &long_cold);
    eprintln!(
        "{test}: restored vs cold: {cached} cached tokens, {same} of {} greedy tokens identical{}, their logprobs \
         within {worst:.2e}",
        long_cold.tokens.len(),
        if same < long_cold.tokens.len() { " (then they part)" } else { "" }
    );
    c.stop().await;
}

/// The restored answer's tokens before it leaves the cold one: their logprobs' median
/// difference may be this (bf16 activations: the rows' error distribution of
/// `engine/tests/common::Bf16Rows`)…
const RESTORED_MEDIAN: f32 = 2e-2;
/// … and none this (a row whose routing or key selection flipped moves ~0.1–0.2).
const RESTORED_MAX: f32 = 0.5;

/// A restored answer against the cold one, whose prefill ran in other batches (cold: the
/// whole prompt, beside another request or not as the timing falls; restored: its last
/// tokens alone). In bf16 activations the products are not batch-invariant (cuBLAS and
/// the expert tiles choose their shapes by the batch: ~1e-4 in the logits), and on this
/// random model every row whose router or indexer scores lie that close takes other
/// experts or keys and moves by ~0.1 (docs/perf.md, "bf16 activations by default"); a
/// greedy step whose top two are that close then falls the other way, and the answers
/// part. Required: the first token the same (a wrong prefix changes the first
/// distribution of this near-flat model entirely: 129,280 candidates), the tokens up to
/// the parting within the bf16 rows' bounds. Returns the tokens in common and the worst
/// logprob difference among them.
fn same_answer_up_to_a_near_tie(hit: &sluice_e2e::Generated, cold: &sluice_e2e::Generated) -> (usize, f32) {
    let (h, c) = (hit.ids(), cold.ids());
    assert_eq!(h.len(), c.len(), "as many tokens restored as cold");
    let same = h.iter().zip(&c).take_while(|(a, b)| a == b).count();
    assert!(same > 0, "restored vs cold: the first token differs ({} against {})", h[0], c[0]);
    let (hl, cl) = (hit.logprobs(), cold.logprobs());
    let mut diffs: Vec<f32> = hl[..same].iter().zip(&cl[..same]).map(|(a, b)| (a - b).abs()).collect();
    diffs.sort_by(f32::total_cmp);
    let (median, worst) = (diffs[diffs.len() / 2], diffs[diffs.len() - 1]);
    assert!(
        median <= RESTORED_MEDIAN && worst <= RESTORED_MAX,
        "restored vs cold: the common tokens' logprobs median {median:.2e} and at most {worst:.2e} apart"
    );
    (same, worst)
}

/// The cluster of the Flash test: a V4-Flash checkpoint of the depth that fills the GPUs,
/// and its services started with bounds that fit loading ~100 GB.
mod flash {
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    use cluster::launch::{ServiceProcess, find_binary, free_port};
    use engine::init::{InitOptions, Preset, WeightDtype, planned_bytes, write_checkpoint};
    use engine::memory_plan::{Residence, pools_from_config};
    use sluice_e2e::Generated;
    use sluice_proto::v1 as pb;
    use tonic::transport::Channel;

    /// GPUs smaller than this are not what the test is for (H200: 141 GB).
    pub const MIN_GPU_BYTES: u64 = 100_000_000_000;
    /// Of each GPU, what the two workers' weights may fill.
    pub const FILL: f64 = 0.75;
    /// Loading ~50 GB a worker, NCCL set-up, kernels from the PTX cache or compiled.
    const START: Duration = Duration::from_secs(600);
    const REQUEST: Duration = Duration::from_secs(180);
    /// Room left beyond the checkpoint where it is written.
    const SPARE_BYTES: u64 = 4_000_000_000;

    fn flash_config(layers: Option<usize>) -> engine::config::ModelConfig {
        engine::config::parse_hf(&Preset::Flash.full_config(layers).expect("flash config")).expect("parse")
    }

    /// Weight bytes on each GPU of a prefill and a decode worker that both span two GPUs,
    /// with `layers` layers: twice one worker's per-GPU share (its routed experts halved,
    /// the rest whole), as the memory plan counts it.
    pub fn weights_per_gpu(layers: usize) -> u64 {
        2 * pools_from_config(&flash_config(Some(layers)), Residence::Gpu, 2).total()
    }

    /// The most layers whose two workers' weights fill at most [`FILL`] of each GPU.
    pub fn layers_filling(gpu_bytes: u64) -> usize {
        let all = flash_config(None).num_layers;
        (1..=all).rev().find(|&l| weights_per_gpu(l) as f64 <= FILL * gpu_bytes as f64).unwrap_or(1)
    }

    pub struct Model {
        pub dir: PathBuf,
        pub vocab: u32,
        _tmp: Option<tempfile::TempDir>,
    }

    fn free_bytes(path: &Path) -> Option<u64> {
        let out = std::process::Command::new("df").args(["-B1", "--output=avail"]).arg(path).output().ok()?;
        String::from_utf8(out.stdout).ok()?.lines().nth(1)?.trim().parse().ok()
    }

    /// The checkpoint: `SLUICE_FLASH_MODEL`, else written to /dev/shm (or the temporary
    /// directory) at the depth that fills the GPUs (`SLUICE_FLASH_LAYERS` overrides),
    /// shallower where there is not the room.
    pub fn checkpoint(test: &str, gpu_bytes: u64) -> Option<Model> {
        if let Some(dir) = std::env::var_os("SLUICE_FLASH_MODEL").map(PathBuf::from) {
            let cfg =
                engine::config::ModelConfig::from_file(&dir.join("config.json")).expect("SLUICE_FLASH_MODEL config");
            eprintln!("{test}: serving {} ({} layers)", dir.display(), cfg.num_layers);
            return Some(Model { dir, vocab: cfg.vocab_size as u32, _tmp: None });
        }
        let layers = match std::env::var("SLUICE_FLASH_LAYERS") {
            Ok(v) => v.parse().expect("SLUICE_FLASH_LAYERS: a layer count"),
            Err(_) => layers_filling(gpu_bytes),
        };
        let opts = |l| InitOptions { layers: Some(l), ..InitOptions::new(Preset::Flash, 0, WeightDtype::Fp8) };
        let bytes = |l| planned_bytes(&opts(l)).expect("full-size preset");
        // /dev/shm (loads at memory speed), else the temporary directory's disk: the one
        // that holds the most layers up to the chosen depth (4 at least; /dev/shm on a tie).
        let fits = |free: u64| (4..=layers).rev().find(|&l| bytes(l) + SPARE_BYTES <= free);
        let room: Vec<(PathBuf, u64)> = [PathBuf::from("/dev/shm"), std::env::temp_dir()]
            .into_iter()
            .filter(|b| b.is_dir())
            .map(|b| {
                let free = free_bytes(&b).unwrap_or(u64::MAX);
                (b, free)
            })
            .collect();
        let Some((base, fit)) =
            room.iter().rev().filter_map(|(b, f)| fits(*f).map(|l| (b.clone(), l))).max_by_key(|&(_, l)| l)
        else {
            let free: Vec<String> =
                room.iter().map(|(b, f)| format!("{} {:.1} GB", b.display(), *f as f64 / 1e9)).collect();
            eprintln!(
                "SKIPPED {test}: {layers} Flash layers need {:.1} GB (4 layers {:.1} GB); free: {}",
                bytes(layers) as f64 / 1e9,
                bytes(4) as f64 / 1e9,
                free.join(", ")
            );
            return None;
        };
        if fit < layers {
            eprintln!("{test}: {} has room for {fit} layers, not {layers}: serving {fit}", base.display());
        }
        let layers = fit;
        let per_gpu = weights_per_gpu(layers);
        eprintln!(
            "{test}: Flash, {layers} layers ({:.1} GB of weights): {:.1} GB of both workers' weights on each GPU of {:.1} \
             GB ({:.0}%)",
            bytes(layers) as f64 / 1e9,
            per_gpu as f64 / 1e9,
            gpu_bytes as f64 / 1e9,
            100.0 * per_gpu as f64 / gpu_bytes as f64
        );
        let tmp = tempfile::Builder::new().prefix("sluice-flash-").tempdir_in(&base).expect("temporary directory");
        let dir = tmp.path().join(format!("flash{layers}"));
        let t = Instant::now();
        let cfg = tokio::task::block_in_place(|| write_checkpoint(&dir, &opts(layers))).expect("write the checkpoint");
        eprintln!("{test}: wrote {} in {:.1} s", dir.display(), t.elapsed().as_secs_f64());
        Some(Model { dir, vocab: cfg.vocab_size as u32, _tmp: Some(tmp) })
    }

    /// kvstore, a decode and a prefill worker over cuda:0 + cuda:1 (each planning for
    /// half of each GPU), a router; processes are killed when dropped.
    pub struct Cluster {
        procs: Vec<ServiceProcess>,
        grpc: String,
        kvstore: String,
        dir: tempfile::TempDir,
    }

    fn url(port: u16) -> String {
        format!("http://127.0.0.1:{port}")
    }

    impl Cluster {
        pub async fn start(model: &Path, gpu_bytes: u64) -> Cluster {
            let dir = tempfile::tempdir().expect("tempdir");
            let logs = dir.path().join("logs");
            let env = vec![("RUST_LOG".to_string(), "info".to_string())];
            let model_arg = model.display().to_string();
            let half = format!("{}MiB", (gpu_bytes / 2) >> 20);
            let mut c = Cluster { procs: Vec::new(), grpc: String::new(), kvstore: String::new(), dir };
            let spawn = |name: &str, bin: &str, args: Vec<String>, port: u16| {
                let bin = find_binary(bin).unwrap_or_else(|e| panic!("{e}"));
                ServiceProcess::spawn(name, &bin, &args, &env, url(port), &logs).expect("spawn")
            };
            let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<String>>();

            let port = free_port();
            let mut args = s(&["--dir", &c.dir.path().join("kvstore").display().to_string()]);
            args.extend(s(&["--listen", &format!("127.0.0.1:{port}"), "--metrics-listen"]));
            args.extend(s(&[&format!("127.0.0.1:{}", free_port()), "--swa-policy", "periodic:256"]));
            args.extend(s(&["--capacity", "8GiB", "--staging-bytes", "512MiB"]));
            let mut kv = spawn("kvstore", "kvstore", args, port);
            kv.wait_healthy(Duration::from_secs(60)).await.expect("kvstore healthy");
            c.kvstore = url(port);
            c.procs.push(kv);

            // Both workers load at once (each reads the whole checkpoint from /dev/shm).
            let t = Instant::now();
            let mut peers = Vec::new();
            for (role, extra) in [
                ("decode", s(&["--max-pages", "128", "--max-sequences", "8", "--max-batch", "8"])),
                ("prefill", s(&["--max-pages", "64", "--max-sequences", "4", "--token-budget", "2048"])),
            ] {
                let port = free_port();
                let mut args = s(&["--model", &model_arg, "--devices", "cuda:0,cuda:1", "--kv-dtype", "fp8"]);
                args.extend(s(&["--gpu-memory", &half, "--listen", &format!("127.0.0.1:{port}")]));
                args.extend(s(&["--metrics-listen", &format!("127.0.0.1:{}", free_port())]));
                args.extend(extra);
                if role == "prefill" {
                    args.extend(s(&["--kvstore", &c.kvstore]));
                }
                peers.push(format!("{role}={}", url(port)));
                c.procs.push(spawn(role, &format!("{role}-worker"), args, port));
            }
            for p in c.procs.iter_mut().skip(1) {
                let name = p.name.clone();
                p.wait_healthy(START).await.unwrap_or_else(|e| panic!("{name} healthy: {e}"));
            }
            eprintln!("both workers ready in {:.1} s", t.elapsed().as_secs_f64());
            for p in &c.procs[1..] {
                let log = std::fs::read_to_string(&p.log).unwrap_or_default();
                for line in log.lines().filter(|l| l.contains("memory plan") || l.contains("loaded weights")) {
                    eprintln!("  {}: {}", p.name, line.trim());
                }
            }

            let (port, http) = (free_port(), free_port());
            let mut args = s(&["--model", &model_arg, "--listen", &format!("127.0.0.1:{port}"), "--http-listen"]);
            args.extend(s(&[&format!("127.0.0.1:{http}"), "--load-poll-ms", "100", "--peers", &peers.join(",")]));
            args.extend(s(&["--kvstore", &c.kvstore]));
            let mut router = spawn("router", "router", args, port);
            router.wait_healthy(Duration::from_secs(60)).await.expect("router healthy");
            c.grpc = url(port);
            c.procs.push(router);
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if let Ok((200, body)) = sluice_e2e::http(&format!("127.0.0.1:{http}"), "GET", "/health", None).await {
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    if v["prefill_workers"].as_u64() >= Some(1) && v["decode_workers"].as_u64() >= Some(1) {
                        break;
                    }
                }
                assert!(Instant::now() < deadline, "the router never saw both workers");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            c
        }

        /// One greedy request (bounded), its token count checked and its timings printed.
        pub async fn generate(&self, what: &str, prompt: Vec<u32>, max_tokens: u32) -> Generated {
            let len = prompt.len();
            let fut = async {
                let ch = Channel::from_shared(self.grpc.clone()).expect("url").connect().await.expect("connect router");
                let req = sluice_e2e::ids_request(prompt, max_tokens);
                let mut client = pb::generation_client::GenerationClient::new(ch);
                let mut stream = client.generate(req).await.expect("generate").into_inner();
                let mut tokens = Vec::new();
                while let Some(ev) = stream.message().await.expect("stream") {
                    match ev.event {
                        Some(pb::generate_event::Event::Token(t)) => tokens.push(t),
                        Some(pb::generate_event::Event::Final(fin)) => return Generated { tokens, fin },
                        None => {}
                    }
                }
                panic!("{what}: the stream ended without a final event");
            };
            let t = Instant::now();
            let got =
                tokio::time::timeout(REQUEST, fut).await.unwrap_or_else(|_| panic!("{what}: no answer in {REQUEST:?}"));
            let wall = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(
                got.tokens.len(),
                max_tokens as usize,
                "{what}: streamed {} of {max_tokens} tokens",
                got.tokens.len()
            );
            let tm = got.fin.timings.unwrap_or_default();
            let cached = got.fin.usage.as_ref().map(|u| u.cached_tokens).unwrap_or(0);
            let per_token = (tm.total_ms - tm.time_to_first_token_ms) / (max_tokens.max(2) - 1) as f64;
            eprintln!(
                "REQUEST {what}: {len} prompt tokens ({cached} cached), {max_tokens} generated; TTFT {:.1} ms (queue \
                 {:.1}, prefill {:.1}, KV transfer {:.1}), total {:.1} ms ({per_token:.2} ms a token after the first), \
                 {wall:.0} ms at the client",
                tm.time_to_first_token_ms, tm.queue_ms, tm.prefill_ms, tm.kv_transfer_ms, tm.total_ms
            );
            got
        }

        /// Wait (bounded) until the store holds `pages` pages, a snapshot, nothing queued.
        pub async fn wait_kvstore(&self, pages: u64) {
            let ch = Channel::from_shared(self.kvstore.clone()).expect("url").connect().await.expect("connect kvstore");
            let mut client = pb::kv_store_client::KvStoreClient::new(ch);
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let s = client.stats(pb::KvStatsRequest {}).await.expect("kvstore stats").into_inner();
                if s.pages >= pages && s.snapshots >= 1 && s.queued_records == 0 {
                    eprintln!(
                        "kvstore: {} pages, {} snapshots, {:.1} MB on disk",
                        s.pages,
                        s.snapshots,
                        s.disk_bytes as f64 / 1e6
                    );
                    return;
                }
                assert!(Instant::now() < deadline, "the kvstore never held {pages} pages: {s:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }

        /// SIGTERM everything, the router first (workers join their engines, bounded).
        pub async fn stop(&mut self) {
            for p in self.procs.iter_mut().rev() {
                p.terminate(Duration::from_secs(30)).await;
            }
        }
    }

    impl Drop for Cluster {
        /// A failing test prints the end of every service's log.
        fn drop(&mut self) {
            if std::thread::panicking() {
                for p in &self.procs {
                    eprintln!("----- {} log (tail) -----\n{}", p.name, p.log_tail(40));
                }
            }
        }
    }

    #[test]
    fn flash_layers_for_two_h200s_fill_three_quarters_of_them() {
        let h200 = engine::memory_plan::H200_BYTES;
        let layers = layers_filling(h200);
        let (fill, next) = (weights_per_gpu(layers), weights_per_gpu(layers + 1));
        let per_layer = weights_per_gpu(layers + 1) - fill;
        let opts = InitOptions { layers: Some(layers), ..InitOptions::new(Preset::Flash, 0, WeightDtype::Fp8) };
        eprintln!(
            "two H200s ({:.1} GB each): {layers} Flash layers (a {:.1} GB checkpoint), {:.1} GB of both workers' \
             weights a GPU ({:.0}%), {:.2} GB more a layer",
            h200 as f64 / 1e9,
            planned_bytes(&opts).unwrap_or(0) as f64 / 1e9,
            fill as f64 / 1e9,
            100.0 * fill as f64 / h200 as f64,
            per_layer as f64 / 1e9
        );
        assert!(fill as f64 <= FILL * h200 as f64 && next as f64 > FILL * h200 as f64);
        assert!((20..=40).contains(&layers), "{layers} layers");
    }
}
