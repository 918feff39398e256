//! `sluice bench engine --device cuda:N`: the GPU engine benchmark. Measured in one run
//! on one device:
//!
//! - the device's copy bandwidth (1 GiB device-to-device copies; bytes read + written),
//!   the ceiling the decode step's achieved bandwidth is compared with;
//! - prefill throughput: the median of one-shot prefills of `--prefill-tokens` (the first
//!   not counted when `--repeat` is 2 or more: library kernels of its shapes load lazily);
//! - decode step time per (context, batch): one sequence is prefilled to the context,
//!   exported and imported `batch` times (identical histories, so the set-up costs one
//!   prefill), then every sequence gets its own token each step (so routing differs
//!   between rows) and the median of `--decode-steps` wall-clock steps is reported (a
//!   step returns logits on the host, so it includes every launch and the sync);
//! - the bytes a step must move (each weight it uses and each KV entry it reads, once,
//!   counted by the backend as it issues the ops) over the step time: achieved GB/s;
//! - the indexer's top-k alone over `--topk-candidates` scores at batch 1, and the
//!   compressor kernel alone over a `--compress-tokens` prefill at V4-Flash widths;
//! - the stored-format products alone (unless `--skip-products`): gemv over FP4 experts
//!   and FP8/BF16 projections (each decode kernel version, v1 and v2, at 1 and 8 rows) and
//!   one decode token's 6 routed FP4 experts (SwiGLU pair + down, v1 and v2) against the
//!   copy bandwidth, the tensor-core GEMMs (FP8 projection, 256 FP4 experts grouped)
//!   against a cuBLAS BF16 GEMM of the same shape. The engine's own decode steps run the
//!   version `SLUICE_CUDA_DECODE_KERNELS` selects (`v2` unless set), printed in the header.
//! - how loading went: bytes, seconds, GB/s and the peak host memory beyond the page
//!   cache.
//!
//! tools/bench/gpu_vs_transformers.sh runs this next to transformers eager on the same
//! GPU and checkpoint.

use std::path::Path;

use anyhow::Result;
use clap::Args;
use engine::EntryDtype;
#[cfg(feature = "cuda")]
use {
    crate::bench_cmd::bench_prompt,
    crate::bench_gpus::MeasuredGpus,
    anyhow::{Context, bail},
    engine::kv::Sequence,
    engine::{CudaBackend, Engine, EngineOptions, Logits},
    kernels::backend::{CompressorParams, KvState},
    kernels::{AttnKind, Backend, BatchPlan, Branch, KvLayout, LayerSpec, RopeTable},
    serde_json::{Value, json},
    std::time::Instant,
};

#[derive(Args, Clone, Debug)]
pub struct GpuBenchArgs {
    /// GPU benchmark: context lengths (tokens already in each sequence) of the decode steps.
    #[arg(long, value_delimiter = ',', default_value = "8192,65536")]
    pub contexts: Vec<usize>,
    /// GPU benchmark: the activations' precision in bf16 products (bf16, the default, or
    /// split; `SLUICE_ACTIVATIONS` when not given).
    #[arg(long)]
    pub activations: Option<kernels::Activations>,
    /// GPU benchmark: batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// GPU benchmark: prompt length of the prefill throughput measurement.
    #[arg(long, default_value_t = 8192)]
    pub prefill_tokens: usize,
    /// GPU benchmark: longest prefill chunk (also used to fill long contexts).
    #[arg(long, default_value_t = 8192)]
    pub chunk_tokens: usize,
    /// GPU benchmark: time the indexer's top-k alone over this many candidates (0: skip).
    #[arg(long, default_value_t = 262144)]
    pub topk_candidates: usize,
    /// GPU benchmark: time the compressor kernel alone over a prefill this long (0: skip).
    #[arg(long, default_value_t = 8192)]
    pub compress_tokens: usize,
    /// GPU benchmark: untimed decode steps of each batch before the timed ones. A decode
    /// step's recorded segments become CUDA graphs the second time they are seen, and the
    /// compressors' entries make steps differ with the position (every 4th and 128th
    /// token), so the first steps of a batch capture graphs (a capture costs the host
    /// ~0.4 ms); 8 covers two rounds of the 4-token cycle, so what is timed is the steady
    /// state a long generation runs in.
    #[arg(long, default_value_t = 8)]
    pub warmup_steps: usize,
    /// GPU benchmark: skip the stored-format product table (FP4/FP8/BF16 gemv and GEMM).
    #[arg(long)]
    pub skip_products: bool,
    /// GPU benchmark: read every decode step's logits back and pick the greedy tokens on
    /// the host (as a sampling request does), instead of the greedy read-out picked on
    /// the device (what a decode worker does for greedy requests).
    #[arg(long)]
    pub full_logits: bool,
    /// GPU benchmark: run even when the memory plan says the model, workspace and KV
    /// pool do not fit the GPUs (the plan is checked before loading).
    #[arg(long)]
    pub skip_memory_check: bool,
}

/// One greedy decode step and the seconds it took from `start`: the device's greedy
/// read-out, or (`full_logits`) every sequence's logits read back, timed up to the read
/// (the host's pick after it, as in the tables before the read-out existed).
#[cfg(feature = "cuda")]
fn decode_greedy<B: Backend>(
    engine: &mut engine::Engine<B>,
    seqs: &mut [&mut engine::kv::Sequence],
    tokens: &[u32],
    full_logits: bool,
    start: Instant,
) -> Result<(Vec<u32>, f64), engine::EngineError> {
    if full_logits {
        let out = engine.decode(seqs, tokens)?;
        let dt = start.elapsed().as_secs_f64();
        return Ok((out.iter().map(|l| engine::sampling::argmax(l)).collect(), dt));
    }
    let with_logits = vec![false; seqs.len()];
    let out = engine.decode_readout(seqs, tokens, &with_logits)?;
    Ok((out.into_iter().map(|r| r.token).collect(), start.elapsed().as_secs_f64()))
}

#[cfg(feature = "cuda")]
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub struct Common<'a> {
    pub dir: &'a Path,
    /// GPUs: one, or several as one sharded engine.
    pub ordinals: Vec<usize>,
    pub kv_dtype: EntryDtype,
    pub decode_steps: usize,
    pub repeat: usize,
    pub json: bool,
}

#[cfg(not(feature = "cuda"))]
pub fn run(c: Common<'_>, a: &GpuBenchArgs) -> Result<()> {
    let _ = (c, a);
    anyhow::bail!("this sluice was built without CUDA support (feature `cuda`)")
}

#[cfg(feature = "cuda")]
pub fn run(c: Common<'_>, a: &GpuBenchArgs) -> Result<()> {
    if a.contexts.is_empty() || a.batches.is_empty() || a.batches.contains(&0) {
        bail!("--contexts and --batches need at least one value each, batches at least 1");
    }
    // The batch's sequences spread over the GPUs; each GPU's share of the pools has
    // room for all of them (rounded to whole shares).
    let max_ctx = *a.contexts.iter().max().expect("non-empty");
    let max_batch = *a.batches.iter().max().expect("non-empty");
    let sizes = crate::bench_memory::BenchSizes::new(
        max_ctx,
        max_batch,
        a.prefill_tokens,
        a.chunk_tokens,
        // The warm-up steps, the timed ones and the three of the device-alone time.
        a.warmup_steps.max(1) + c.decode_steps + 3,
        c.ordinals.len(),
    );
    let plan = crate::bench_memory::plan_run(c.dir, &c.ordinals, c.kv_dtype, &sizes);
    let plan = if a.skip_memory_check {
        eprintln!("memory plan not checked (--skip-memory-check)");
        plan.ok().map(|(p, _)| p)
    } else {
        let (plan, label) = plan?;
        sizes.check(&plan, &label).map_err(anyhow::Error::msg)?;
        Some(plan)
    };
    let run = Run { sizes, plan };
    if let Some(act) = a.activations {
        kernels::Activations::set_process_default(act);
    }
    match c.ordinals.as_slice() {
        [one] => run_on(&c, a, &run, engine::device::cuda_backend(*one)?),
        several => run_on(&c, a, &run, engine::device::cuda_sharded(several)?),
    }
}

/// What is decided before loading: the engine's sizes and their memory plan (none when
/// the check was skipped and the plan could not be made).
#[cfg(feature = "cuda")]
struct Run {
    sizes: crate::bench_memory::BenchSizes,
    plan: Option<engine::memory_plan::MemoryPlan>,
}

#[cfg(feature = "cuda")]
fn run_on<B: MeasuredGpus>(c: &Common<'_>, a: &GpuBenchArgs, run: &Run, backend: B) -> Result<()> {
    let describe = backend.describe();
    let activations = backend.first().activations();
    eprintln!("{describe}; kernels: {}; activations: {activations}", backend.first().kernel_origin());
    let copy_gbs = backend.copy_gbs();
    // The tensor-core ceiling prefill is read against, on the first GPU.
    let peak_tflops = backend.first().bf16_peak_tflops(20);
    eprintln!("cuBLAS BF16 GEMM 8192³: {peak_tflops:.0} TFLOP/s (the prefill's ceiling, per GPU)");
    let ranks = backend.ranks();

    let opts = EngineOptions {
        kv_dtype: c.kv_dtype,
        max_pages: run.sizes.max_pages,
        max_sequences: run.sizes.max_sequences,
        max_chunk_tokens: a.chunk_tokens.max(1),
    };
    let t = Instant::now();
    let mut engine = Engine::load(c.dir, backend, opts).with_context(|| format!("loading {}", c.dir.display()))?;
    let load_s = t.elapsed().as_secs_f64();
    let vocab = engine.config().vocab_size;
    let (free, total) = engine.model.backend.memory();
    eprintln!(
        "loaded in {load_s:.1} s; device memory {:.1} of {:.1} GiB free",
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64
    );
    // The memory plan's weight figure next to what the device holds after loading (the
    // KV pool, context and kernels included in the latter).
    let plan_weights = run.plan.as_ref().map(|p| (p.weights.total(), p.workspace));
    let used_after_load = (total - free) as u64;

    // Warm-up: kernels loaded, cuBLAS handles and the allocator's pool primed.
    let mut seq = engine.open_sequence()?;
    engine.prefill(&mut seq, &bench_prompt(a.prefill_tokens.min(512), vocab, 7), Logits::Last)?;
    engine.decode(&mut [&mut seq], &[1])?;
    engine.release(seq);

    // Prefill throughput.
    let prompt = bench_prompt(a.prefill_tokens, vocab, 1);
    let mut prefill_s = Vec::new();
    let mut prefill_traffic = (0, 0);
    let mut prefill_flops = 0;
    for i in 0..c.repeat.max(1) {
        if i == 1 {
            // The first prefill of this length meets new GEMM shapes (library kernels
            // loaded lazily): keep it out of the profile.
            engine.model.backend.profile();
        }
        let mut seq = engine.open_sequence()?;
        engine.model.backend.traffic();
        engine.model.backend.flops();
        let t = Instant::now();
        engine.prefill(&mut seq, &prompt, Logits::Last)?;
        prefill_s.push(t.elapsed().as_secs_f64());
        prefill_traffic = engine.model.backend.traffic();
        prefill_flops = engine.model.backend.flops();
        engine.release(seq);
    }
    // The first prefill of this length meets its GEMM shapes first (cuBLAS loads their
    // kernels lazily: tens of ms), so with more than one it is not timed.
    let timed = if prefill_s.len() > 1 { &prefill_s[1..] } else { &prefill_s[..] };
    let prefill_secs = median(timed.to_vec());
    let prefill_tps = a.prefill_tokens as f64 / prefill_secs;
    // The products' FLOPs over the time, against the peak of all the GPUs together; then
    // with attention's (q·Kᵀ and P·V over the keys each token attends to, which the
    // tensor cores run too: the usual model-FLOPs count) added.
    let prefill_tflops = prefill_flops as f64 / prefill_secs / 1e12;
    let prefill_of_peak = prefill_tflops / (peak_tflops * ranks as f64);
    let attention_flops = prefill_attention_flops(&engine.model.layout, engine.config(), a.prefill_tokens);
    let with_attention_tflops = (prefill_flops as f64 + attention_flops) / prefill_secs / 1e12;
    let with_attention_of_peak = with_attention_tflops / (peak_tflops * ranks as f64);
    eprintln!(
        "prefill {} tokens: {prefill_tps:.0} tokens/s, products {:.2} TFLOP at {prefill_tflops:.0} TFLOP/s \
         ({:.0}% of the cuBLAS BF16 peak)",
        a.prefill_tokens,
        prefill_flops as f64 / 1e12,
        100.0 * prefill_of_peak
    );
    let profiled = if c.repeat > 1 { c.repeat - 1 } else { 1 };
    print_profile(&engine.model.backend, &format!("{profiled} prefills of {} tokens", a.prefill_tokens), None);

    let mut decode_rows = Vec::new();
    for &ctx in &a.contexts {
        let mut template = engine.open_sequence()?;
        engine.prefill(&mut template, &bench_prompt(ctx, vocab, 100 + ctx as u64), Logits::Last)?;
        let bytes = engine.export(&template);
        engine.release(template);
        engine.model.backend.profile();
        for &batch in &a.batches {
            let mut seqs: Vec<Sequence> = (0..batch).map(|_| engine.import(&bytes)).collect::<Result<_, _>>()?;
            let mut next: Vec<u32> = bench_prompt(batch, vocab, 1000 + batch as u64);
            let mut steps = Vec::new();
            let mut traffic = Vec::new();
            let mut launches = Vec::new();
            // Untimed steps first (at least one: the plan shape and buffers of this batch
            // are new, kernels load lazily; then graph captures, `--warmup-steps`).
            let warmup = a.warmup_steps.max(1);
            for i in 0..warmup + c.decode_steps {
                if i == warmup {
                    // What the timed steps did from here on.
                    engine.model.backend.graphs();
                }
                let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
                engine.model.backend.traffic();
                engine.model.backend.launches();
                let (out, dt) = decode_greedy(&mut engine, &mut refs, &next, a.full_logits, Instant::now())?;
                let (w, kv) = engine.model.backend.traffic();
                let n_launches = engine.model.backend.launches();
                if i >= warmup {
                    steps.push(dt);
                    traffic.push((w + kv) as f64);
                    launches.push(n_launches);
                } else {
                    // Warm-up steps are not in the profile.
                    engine.model.backend.profile();
                }
                next = out;
            }
            let steps_wall: f64 = steps.iter().sum();
            let step = median(steps);
            let bytes_per_step = traffic.iter().sum::<f64>() / traffic.len() as f64;
            let gbs = bytes_per_step / step / 1e9;
            let launches_per_step = launches.iter().sum::<u64>() as f64 / launches.len().max(1) as f64;
            let graphs = engine.model.backend.graphs();
            eprintln!(
                "decode ctx {ctx} batch {batch}: {} of {} step segments from CUDA graphs ({} captured, {} eager) \
                 in {} recorded steps, {} ops issued past their recording; {:.2} ms a step issuing segments",
                graphs.replayed + graphs.captured,
                graphs.segments,
                graphs.captured,
                graphs.eager,
                graphs.recorded,
                graphs.unrecorded,
                graphs.issue_seconds * 1e3 / graphs.recorded.max(1) as f64
            );
            eprintln!(
                "decode ctx {ctx} batch {batch}: {:.3} ms/step, {:.0} MB/step, {gbs:.0} GB/s ({:.0}% of copy), \
                 {launches_per_step:.0} launches/step",
                step * 1e3,
                bytes_per_step / 1e6,
                100.0 * gbs / copy_gbs
            );
            let what = format!("{} decode steps, ctx {ctx} batch {batch}", c.decode_steps);
            print_profile(&engine.model.backend, &what, Some(steps_wall));
            // The device's own step time: steps queued behind a hold longer than the
            // host takes to issue a step (at most the step's wall time, so twice that, and
            // at least 20 ms), so the device starts with everything issued (the hold
            // subtracted).
            let hold = (2.0 * step).max(0.02);
            let mut device_steps = Vec::new();
            for _ in 0..3 {
                let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
                let t = Instant::now();
                engine.model.backend.hold((hold * 1e9) as u64);
                let (out, dt) = decode_greedy(&mut engine, &mut refs, &next, a.full_logits, t)?;
                next = out;
                device_steps.push(dt - hold);
            }
            engine.model.backend.traffic();
            engine.model.backend.profile();
            let device_step = median(device_steps);
            eprintln!("decode ctx {ctx} batch {batch}: {:.3} ms/step on the device alone", device_step * 1e3);
            for s in seqs {
                engine.release(s);
            }
            decode_rows.push(json!({
                "context": ctx, "batch": batch, "ms_per_step": step * 1e3, "device_ms_per_step": device_step * 1e3,
                "tokens_per_s": batch as f64 / step, "bytes_per_step": bytes_per_step,
                "achieved_gb_s": gbs, "fraction_of_copy": gbs / copy_gbs, "launches_per_step": launches_per_step,
                "graph_segments": graphs.segments, "graph_replays": graphs.replayed + graphs.captured,
                "graph_captures": graphs.captured, "graph_unrecorded_ops": graphs.unrecorded,
                "full_logits": a.full_logits,
            }));
        }
    }

    let topk = if a.topk_candidates > 0 {
        let k = engine.config().index_topk;
        Some(engine.model.backend.first().time_topk(a.topk_candidates, k, 50))
    } else {
        None
    };
    let compress = if a.compress_tokens > 0 {
        Some(compress_bench(engine.model.backend.first(), a.compress_tokens, c.kv_dtype, c.repeat.max(20)))
    } else {
        None
    };

    let products =
        if a.skip_products { Vec::new() } else { engine.model.backend.first().bench_products(c.repeat.max(10)) };
    let products: Vec<Value> = products
        .iter()
        .map(|p| {
            json!({
                "what": p.what, "us": p.us,
                "gb_s": (p.bytes > 0.0).then(|| p.bytes / (p.us / 1e6) / 1e9),
                "fraction_of_copy": (p.bytes > 0.0).then(|| p.bytes / (p.us / 1e6) / 1e9 / copy_gbs),
                "tflop_s": p.flops / (p.us / 1e6) / 1e12,
                "cublas_bf16_us": p.cublas_us,
                "vs_cublas_bf16": p.cublas_us.map(|c| c / p.us),
            })
        })
        .collect();
    let load = &engine.load;
    let used_at_end = {
        let (f, t) = engine.model.backend.memory();
        (t - f) as u64
    };

    let report = json!({
        "engine": "sluice",
        "device": describe,
        "model": c.dir.display().to_string(),
        "kv_dtype": c.kv_dtype.name(),
        "activations": activations.name(),
        "copy_gb_s": copy_gbs,
        "decode_kernels": engine.model.backend.first().decode_kernels(),
        "load_s": load_s,
        "memory": json!({
            "plan_weights": plan_weights.map(|p| p.0), "plan_workspace": plan_weights.map(|p| p.1),
            "used_after_load": used_after_load,
            "used_at_end": used_at_end,
        }),
        "load": json!({
            "bytes": load.bytes, "seconds": load.seconds, "gb_s": load.gb_per_s(),
            "peak_extra_host_bytes": load.peak_extra_host_bytes,
        }),
        "products": products,
        "prefill_tokens": a.prefill_tokens,
        "prefill_tokens_per_s": prefill_tps,
        "prefill_product_flops": prefill_flops,
        "prefill_product_tflop_s": prefill_tflops,
        "prefill_fraction_of_bf16_peak": prefill_of_peak,
        "prefill_attention_flops": attention_flops,
        "prefill_with_attention_tflop_s": with_attention_tflops,
        "prefill_with_attention_fraction_of_bf16_peak": with_attention_of_peak,
        "bf16_peak_tflop_s": peak_tflops,
        "prefill_bytes": prefill_traffic.0 + prefill_traffic.1,
        "decode": decode_rows,
        "topk": topk.map(|t| json!({
            "candidates": a.topk_candidates, "k": engine.config().index_topk,
            "us": t.gpu_us, "issued_us": t.issued_us,
        })),
        "compress": compress,
    });
    if c.json {
        println!("{report}");
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Where the time went, per op (only with `SLUICE_CUDA_PROFILE`: the first GPU's device
/// times, or the host's in every GPU's ops with `host`, where ops nest and the total is
/// that of the outermost ones). `wall`: the profiled steps' wall time, which a host
/// profile is set against (the rest is the engine's own code).
#[cfg(feature = "cuda")]
fn print_profile<B: MeasuredGpus>(b: &B, what: &str, wall: Option<f64>) {
    let Some(mut p) = b.profile() else { return };
    let outermost = p.iter().position(|e| e.0 == kernels::cuda::HOST_OUTERMOST).map(|i| p.remove(i).1);
    let total = outermost.unwrap_or_else(|| p.iter().map(|x| x.1).sum());
    match (outermost, wall) {
        (Some(_), Some(w)) => eprintln!(
            "host profile of {what} ({:.1} ms in ops of {:.1} ms wall, {:.1} ms outside ops; ops nest):",
            total * 1e3,
            w * 1e3,
            (w - total) * 1e3
        ),
        (Some(_), None) => eprintln!("host profile of {what} ({:.1} ms in ops; ops nest):", total * 1e3),
        (None, _) => eprintln!("profile of {what} ({:.1} ms in ops):", total * 1e3),
    }
    for (name, t, n) in p {
        eprintln!("  {name:<18} {:>9.2} ms {:>5.1}% {n:>7} calls", t * 1e3, 100.0 * t / total);
    }
}

#[cfg(feature = "cuda")]
fn print_table(r: &Value) {
    println!(
        "sluice engine on {} (KV {}, activations {})",
        r["device"].as_str().unwrap_or("?"),
        r["kv_dtype"].as_str().unwrap_or("?"),
        r["activations"].as_str().unwrap_or("?")
    );
    println!("  copy bandwidth        {:>10.0} GB/s", r["copy_gb_s"].as_f64().unwrap_or(0.0));
    println!(
        "  decode kernels        {:>10} (SLUICE_CUDA_DECODE_KERNELS; the product table times both)",
        r["decode_kernels"].as_str().unwrap_or("?")
    );
    let m = &r["memory"];
    println!(
        "  memory                plan: weights {:.2} GB, workspace {:.2} GB; device in use after load {:.2} GB, at the end {:.2} GB",
        m["plan_weights"].as_f64().unwrap_or(0.0) / 1e9,
        m["plan_workspace"].as_f64().unwrap_or(0.0) / 1e9,
        m["used_after_load"].as_f64().unwrap_or(0.0) / 1e9,
        m["used_at_end"].as_f64().unwrap_or(0.0) / 1e9
    );
    let l = &r["load"];
    println!(
        "  load                  {:>10.2} GB in {:.1} s ({:.2} GB/s), peak host memory beyond page cache {} MiB",
        l["bytes"].as_f64().unwrap_or(0.0) / 1e9,
        l["seconds"].as_f64().unwrap_or(0.0),
        l["gb_s"].as_f64().unwrap_or(0.0),
        l["peak_extra_host_bytes"].as_u64().map(|b| (b >> 20).to_string()).unwrap_or_else(|| "?".into())
    );
    println!(
        "  prefill {:>6} tokens {:>10.0} tokens/s, products at {:.0} TFLOP/s = {:.1}% of the cuBLAS BF16 peak ({:.0} TFLOP/s a GPU); \
         with attention's {:.0} TFLOP/s = {:.1}%",
        r["prefill_tokens"].as_u64().unwrap_or(0),
        r["prefill_tokens_per_s"].as_f64().unwrap_or(0.0),
        r["prefill_product_tflop_s"].as_f64().unwrap_or(0.0),
        100.0 * r["prefill_fraction_of_bf16_peak"].as_f64().unwrap_or(0.0),
        r["bf16_peak_tflop_s"].as_f64().unwrap_or(0.0),
        r["prefill_with_attention_tflop_s"].as_f64().unwrap_or(0.0),
        100.0 * r["prefill_with_attention_fraction_of_bf16_peak"].as_f64().unwrap_or(0.0)
    );
    println!(
        "  {:>8} {:>6} {:>10} {:>10} {:>10} {:>9} {:>7}",
        "context", "batch", "ms/step", "device ms", "MB/step", "GB/s", "% copy"
    );
    for d in r["decode"].as_array().into_iter().flatten() {
        println!(
            "  {:>8} {:>6} {:>10.3} {:>10.3} {:>10.1} {:>9.0} {:>6.0}%",
            d["context"].as_u64().unwrap_or(0),
            d["batch"].as_u64().unwrap_or(0),
            d["ms_per_step"].as_f64().unwrap_or(0.0),
            d["device_ms_per_step"].as_f64().unwrap_or(0.0),
            d["bytes_per_step"].as_f64().unwrap_or(0.0) / 1e6,
            d["achieved_gb_s"].as_f64().unwrap_or(0.0),
            100.0 * d["fraction_of_copy"].as_f64().unwrap_or(0.0)
        );
    }
    // Kernel times: back to back on the device; in brackets, one call issued alone.
    if let Some(t) = r["topk"].as_object() {
        println!(
            "  top-{} of {} candidates: {:.1} us ({:.1} us issued alone)",
            t["k"],
            t["candidates"],
            t["us"].as_f64().unwrap_or(0.0),
            t["issued_us"].as_f64().unwrap_or(0.0)
        );
    }
    for p in r["products"].as_array().into_iter().flatten() {
        let us = p["us"].as_f64().unwrap_or(0.0);
        match (p["gb_s"].as_f64(), p["vs_cublas_bf16"].as_f64()) {
            (Some(gbs), _) => println!(
                "  {:<58} {us:>9.1} us {gbs:>7.0} GB/s ({:.0}% of copy)",
                p["what"].as_str().unwrap_or("?"),
                100.0 * p["fraction_of_copy"].as_f64().unwrap_or(0.0)
            ),
            (None, Some(ratio)) => println!(
                "  {:<58} {us:>9.1} us {:>7.0} TFLOP/s ({ratio:.2}x cuBLAS bf16 at {:.1} us)",
                p["what"].as_str().unwrap_or("?"),
                p["tflop_s"].as_f64().unwrap_or(0.0),
                p["cublas_bf16_us"].as_f64().unwrap_or(0.0)
            ),
            _ => {}
        }
    }
    for c in r["compress"].as_array().into_iter().flatten() {
        println!(
            "  compressor {} ({} tokens): {:.1} us, {:.0} GB/s ({:.1} us issued alone)",
            c["kind"].as_str().unwrap_or("?"),
            c["tokens"],
            c["us"].as_f64().unwrap_or(0.0),
            c["gb_s"].as_f64().unwrap_or(0.0),
            c["issued_us"].as_f64().unwrap_or(0.0)
        );
    }
}

/// The compressor kernels alone (pooling, norm, RoPE, page writes and the ring update)
/// over one prefill of `tokens` at V4-Flash widths: CSA (ratio 4, 2 × 512 channels)
/// and HCA (ratio 128, 512). Bytes: the kv and score projections and the position bias
/// read once, the entries and the ring written once.
#[cfg(feature = "cuda")]
fn compress_bench(b: &CudaBackend, tokens: usize, dtype: EntryDtype, reps: usize) -> Value {
    let mut out = Vec::new();
    for (kind, ratio) in [(AttnKind::Csa, 4usize), (AttnKind::Hca, 128)] {
        let spec = LayerSpec {
            kind,
            ratio,
            head_dim: 512,
            index_dim: if kind == AttnKind::Csa { 128 } else { 0 },
            rope_dim: 64,
        };
        let layout = KvLayout::new(128, 128, dtype, &[spec]);
        let lk = &layout.layers[0];
        let width = lk.comp_width(Branch::Main);
        let pages = tokens.div_ceil(128);
        let mut kv = KvState::<CudaBackend> {
            pages: b.kv_alloc(pages * layout.page_elems, dtype),
            rings: b.kv_alloc(layout.ring_elems, dtype),
            comp: b.kv_alloc(layout.comp_elems, EntryDtype::F32),
        };
        let toks = vec![0u32; tokens];
        let plan = BatchPlan::new(vec![(0, (0..pages as u32).collect(), 0, &toks)]);
        let noise = |n: usize, salt: u64| -> Vec<f32> {
            bench_prompt(n, 1 << 20, salt).into_iter().map(|v| v as f32 / (1 << 19) as f32 - 1.0).collect()
        };
        let proj_kv = b.upload(&noise(tokens * width, 1));
        let proj_score = b.upload(&noise(tokens * width, 2));
        let ape = b.upload(&noise(ratio * width, 3));
        let norm = b.upload(&vec![1.0; 512]);
        let rope = RopeTable::plain(160000.0, 64);
        let p = CompressorParams::<CudaBackend> { ape: &ape, norm: &norm, eps: 1e-6, rope: &rope };
        let t = b.time_kernel_us(reps, || {
            b.compress(&mut kv.view_mut(), &layout, 0, Branch::Main, &plan, &proj_kv, &proj_score, &p)
        });
        let entries = tokens / ratio;
        let slots = lk.comp_slots();
        let bytes = 2 * tokens * width * 4 + ratio * width * 4 + entries * 512 * dtype.size() + 2 * slots * width * 4;
        out.push(json!({
            "kind": kind.name(), "ratio": ratio, "tokens": tokens, "us": t.gpu_us, "issued_us": t.issued_us,
            "bytes": bytes, "gb_s": bytes as f64 / (t.gpu_us / 1e6) / 1e9,
        }));
    }
    Value::Array(out)
}

/// Attention's FLOPs in a prefill of `tokens` tokens from position 0: q·Kᵀ and P·V
/// (2·head_dim each a head) over the keys each token attends to in each layer
/// (`KvLayout::attended_keys`: its window and the compressed entries it sees).
fn prefill_attention_flops(layout: &kernels::KvLayout, c: &engine::config::ModelConfig, tokens: usize) -> f64 {
    let per_key = |l: usize| 4.0 * c.num_heads as f64 * layout.layers[l].spec.head_dim as f64;
    (0..layout.layers.len())
        .map(|l| (0..tokens).map(|t| layout.attended_keys(l, t, c.index_topk) as f64).sum::<f64>() * per_key(l))
        .sum()
}
