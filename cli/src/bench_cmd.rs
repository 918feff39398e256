//! `sluice bench engine`: prefill throughput and decode step time of the CPU engine,
//! measured the same way tools/bench/transformers_cpu.py measures transformers so the
//! two can be put side by side; with `--device cuda:N`, the GPU benchmark of
//! `bench_engine`. Also dispatches `sluice bench transfer`
//! (`bench_transfer`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
use engine::{CpuBackend, Device, Engine, EngineOptions, EntryDtype, Logits};
use serde_json::json;

use crate::{args, bench_transfer};

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Prefill tokens/s and decode ms/step of the in-process engine.
    Engine(EngineArgs),
    /// GB/s of the KV sender between two processes, next to ucx_perftest.
    Transfer(bench_transfer::TransferArgs),
    /// Sequential write and read GB/s of pages through the kvstore, next to fio.
    Kvstore(crate::bench_kvstore::KvstoreArgs),
    /// Per SWA policy: bytes stored per shared prefix, tokens recomputed and TTFT on a hit vs cold.
    Prefix(crate::bench_prefix::PrefixArgs),
    /// NCCL all-gather + reduce-scatter vs all-to-all dispatch + combine of MoE rows between GPUs.
    Collectives(crate::bench_collectives::CollectivesArgs),
    /// Load through a running router: request-rate sweeps of a generated workload (TTFT, ITL, tokens/s, prefix hits).
    Serve(crate::bench_serve::ServeArgs),
}

#[derive(Args)]
pub struct EngineArgs {
    /// Model directory; without it the `small` preset (seed 0; `flash-bench` on a GPU)
    /// is written to a temporary directory first.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Decode steps to time after the prompt.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// Sequences decoded together per step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed repetitions of the prefill (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long, default_value = "f32", value_parser = args::kv_dtype)]
    kv_dtype: EntryDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// cpu, or cuda:N for the GPU benchmark (contexts x batches, see the options below).
    #[arg(long, default_value = "cpu", value_parser = args::device)]
    device: Device,
    /// Several GPUs as one engine, e.g. `cuda:0,cuda:1` (the GPU benchmark over all of
    /// them: copy bandwidth and bytes summed); replaces --device.
    #[arg(long, conflicts_with = "device")]
    devices: Option<engine::device::DeviceList>,
    #[command(flatten)]
    gpu: crate::bench_engine::GpuBenchArgs,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Deterministic pseudo-random prompt (an LCG; the values only need to vary).
pub fn bench_prompt(len: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Engine(a) => engine(a),
        BenchCmd::Transfer(a) => bench_transfer::run(a),
        BenchCmd::Kvstore(a) => crate::bench_kvstore::run(a),
        BenchCmd::Prefix(a) => crate::bench_prefix::run(a),
        BenchCmd::Collectives(a) => crate::bench_collectives::run(a),
        BenchCmd::Serve(a) => crate::bench_serve::run(a),
    }
}

fn engine(a: EngineArgs) -> Result<()> {
    let _tmp;
    let preset = if a.device.is_cuda() || a.devices.is_some() { Preset::FlashBench } else { Preset::Small };
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => {
            _tmp = tempfile::tempdir()?;
            let d = _tmp.path().join(preset.name());
            eprintln!("no --model: writing the {} preset to {} ...", preset.name(), d.display());
            write_checkpoint(&d, &InitOptions::new(preset, 0, WeightDtype::Bf16))?;
            d
        }
    };
    let devices = engine::device::chosen(a.device, a.devices.as_ref());
    if devices.iter().all(|d| d.is_cuda()) {
        let ordinals = devices.iter().map(|d| if let Device::Cuda(n) = d { *n } else { 0 }).collect();
        let common = crate::bench_engine::Common {
            dir: &dir,
            ordinals,
            kv_dtype: a.kv_dtype,
            decode_steps: a.decode_steps,
            repeat: a.repeat,
            json: a.json,
        };
        return crate::bench_engine::run(common, &a.gpu);
    }
    let pages_per_seq = (a.prompt_tokens + a.decode_steps).div_ceil(128) + 1;
    let opts = EngineOptions {
        kv_dtype: a.kv_dtype,
        max_pages: pages_per_seq * a.batch.max(1) + pages_per_seq,
        max_sequences: a.batch.max(1) + 1,
        max_chunk_tokens: a.prompt_tokens.max(1),
    };
    let mut engine =
        Engine::load(&dir, CpuBackend::new(), opts).with_context(|| format!("loading {}", dir.display()))?;
    let vocab = engine.config().vocab_size;
    let threads = rayon::current_num_threads();
    let prompt = bench_prompt(a.prompt_tokens, vocab, 1);

    // Warm-up (page faults of the weight mapping, allocator), then timed prefills.
    let mut seq = engine.open_sequence()?;
    engine.prefill(&mut seq, &prompt[..prompt.len().min(16)], Logits::Last)?;
    engine.release(seq);
    let mut prefill_s = Vec::new();
    for _ in 0..a.repeat.max(1) {
        let mut seq = engine.open_sequence()?;
        let t = Instant::now();
        engine.prefill(&mut seq, &prompt, Logits::Last)?;
        prefill_s.push(t.elapsed().as_secs_f64());
        engine.release(seq);
    }
    let prefill_tps = a.prompt_tokens as f64 / median(prefill_s);

    // Decode: `batch` sequences with the same prompt, stepped together.
    let mut seqs = Vec::new();
    let mut next = Vec::new();
    for b in 0..a.batch.max(1) {
        let mut s = engine.open_sequence()?;
        let p = bench_prompt(a.prompt_tokens, vocab, 100 + b as u64);
        let logits = engine.prefill(&mut s, &p, Logits::Last)?;
        next.push(engine::sampling::argmax(&logits));
        seqs.push(s);
    }
    let mut step_s = Vec::new();
    for _ in 0..a.decode_steps {
        let mut refs: Vec<&mut engine::kv::Sequence> = seqs.iter_mut().collect();
        let t = Instant::now();
        let out = engine.decode(&mut refs, &next)?;
        step_s.push(t.elapsed().as_secs_f64());
        next = out.iter().map(|l| engine::sampling::argmax(l)).collect();
    }
    for s in seqs {
        engine.release(s);
    }
    let step_ms = median(step_s) * 1e3;
    let report = json!({
        "engine": "sluice",
        "device": "cpu",
        "threads": threads,
        "model": dir.display().to_string(),
        "prompt_tokens": a.prompt_tokens,
        "batch": a.batch,
        "prefill_tokens_per_s": prefill_tps,
        "decode_ms_per_step": step_ms,
        "decode_tokens_per_s": a.batch as f64 / (step_ms / 1e3),
    });
    if a.json {
        println!("{report}");
    } else {
        println!("sluice engine on cpu ({threads} threads), {} prompt tokens, batch {}", a.prompt_tokens, a.batch);
        println!("  prefill  {prefill_tps:>10.1} tokens/s");
        println!("  decode   {step_ms:>10.2} ms/step ({:.1} tokens/s)", a.batch as f64 / (step_ms / 1e3));
    }
    Ok(())
}
