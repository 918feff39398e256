//! Decode steps replayed as CUDA graphs give what the same steps issued kernel by kernel
//! give (`SLUICE_CUDA_GRAPHS`; kernels/src/cuda/step_graph.rs).
//!
//! Two engines on GPU 0 load one checkpoint (the `small` preset, every attention kind and
//! both MoE kinds), one with graphs, one without, and decode the same sequences: one
//! sequence alone, then three of different lengths together (their compressors complete
//! entries on different steps), each over enough steps to cross compressed-entry and
//! page boundaries; with BF16 weights also twelve sequences, whose products take cuBLAS
//! (recorded into the graphs like kernels). Logits must agree to 1e-5 of their scale,
//! every greedy token must be the same, and three in four step segments must really have
//! been replayed (a graph path that never replays would otherwise pass). FP8 KV and
//! FP8/FP4 weights too.
//!
//! A sharded engine (two ranks: on both GPUs of a two-GPU machine, and on one GPU twice)
//! the same way: every rank records, the exchanges end its segments.
//!
//! Six engines on six threads of one process capture their steps while the others
//! prefill and decode, and agree with each other (calls that synchronize the context wait
//! for captures: `kernels/src/cuda/capture_lock.rs`; the driver crashed otherwise).
//!
//! Also the greedy read-out picked on the device (`Engine::decode_readout`): the token and
//! log-probability the host's greedy sampler gives on the same step's logits.
//!
//! Without a GPU every test prints that it is skipped and passes.
#![cfg(feature = "cuda")]

mod common;

use common::{argmax, gpu, gpu_in, max_abs_diff, prompt};
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
use engine::{Activations, CudaBackend, Engine, EngineOptions, EntryDtype, Logits};

/// Graphs replay the kernels the eager step issues, with the same arguments: the only
/// differences allowed are those of a kernel that sums in a run-dependent order.
const GRAPH_TOL: f32 = 1e-5;

/// This file's tests run one at a time, so that each test's graph counts are its own
/// engines' alone. (Another engine of the process loading weights beside a capture no
/// longer makes the driver refuse it: the calls that synchronize the context wait for
/// captures, `kernels/src/cuda/capture_lock.rs`; the many-threads test below checks it.)
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The `small` preset (every attention kind and both MoE kinds) with `weights`, in a
/// temporary directory that lives as long as the first value.
fn small_checkpoint(weights: WeightDtype) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    write_checkpoint(&model, &InitOptions::new(Preset::Small, 5, weights)).unwrap();
    (dir, model)
}

/// FP8 KV, 64 pages, up to four sequences, chunks of 512 tokens.
fn fp8_options() -> EngineOptions {
    EngineOptions { kv_dtype: EntryDtype::Fp8, max_pages: 64, max_sequences: 4, max_chunk_tokens: 512 }
}

/// Prefill `lens.len()` sequences, then decode them together greedily for `steps` steps;
/// every step's logits.
fn decode<B: kernels::Backend>(e: &mut Engine<B>, lens: &[usize], steps: usize) -> Vec<Vec<f32>> {
    let vocab = e.config().vocab_size;
    let mut seqs: Vec<_> = lens.iter().map(|_| e.open_sequence().unwrap()).collect();
    let mut next = Vec::new();
    for (i, (s, &n)) in seqs.iter_mut().zip(lens).enumerate() {
        let last = e.prefill(s, &prompt(n, vocab, i as u64 + 1), Logits::Last).unwrap();
        next.push(argmax(&last));
    }
    let mut logits = Vec::new();
    for _ in 0..steps {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let out = e.decode(&mut refs, &next).unwrap();
        next = out.iter().map(|l| argmax(l)).collect();
        logits.extend(out);
    }
    for s in seqs {
        e.release(s);
    }
    logits
}

/// The largest error of any row of `got` against the same row of `want`, relative to
/// that row's largest magnitude (NaN counts as infinite); every row's greedy token must
/// be the same.
fn worst_row_error(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: as many logit rows");
    let mut worst = 0f32;
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(argmax(a), argmax(b), "{what}: greedy token of row {i} differs");
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        worst = worst.max(max_abs_diff(a, b) / scale);
    }
    worst
}

fn graphs_match_eager(test: &str, weights: WeightDtype, kv_dtype: EntryDtype) {
    let _one = one_at_a_time();
    let (Some(with), Some(without)) = (gpu(test), gpu(test)) else { return };
    without.set_graphs(false);
    let (_dir, model) = small_checkpoint(weights);
    let opts = EngineOptions { kv_dtype, max_sequences: 12, ..fp8_options() };
    let g = Engine::load(&model, with, opts.clone()).unwrap();
    let e = Engine::load(&model, without, opts).unwrap();
    let what = format!("{test} ({weights:?} weights, {} KV)", kv_dtype.name());
    // One sequence past a page and several compressed entries of every ratio; then three
    // of different lengths; with BF16 weights also twelve, whose products and routed
    // experts go to cuBLAS (9 rows and more), recorded into the graphs with the kernels.
    let mut cases = vec![(vec![250], 140), (vec![700, 261, 5], 48)];
    if weights == WeightDtype::Bf16 {
        cases.push((vec![5, 17, 30, 41, 52, 60, 66, 71, 24, 9, 45, 38], 48));
    }
    cases_match(&what, g, e, cases);
}

/// Each case (prompt lengths, decode steps) decoded by `g` (graphs on) and `e` (off): the
/// same greedy tokens, logits within GRAPH_TOL, three in four segments replayed.
fn cases_match(what: &str, mut g: Engine<CudaBackend>, mut e: Engine<CudaBackend>, cases: Vec<(Vec<usize>, usize)>) {
    for (lens, steps) in cases {
        g.model.backend.take_graph_stats();
        let got = decode(&mut g, &lens, steps);
        let stats = g.model.backend.take_graph_stats();
        let want = decode(&mut e, &lens, steps);
        let eager = e.model.backend.take_graph_stats();
        assert_eq!(eager.recorded, 0, "{what}: graphs switched off still recorded steps");
        let worst = worst_row_error(&got, &want, &format!("{what}, batch {lens:?}"));
        let (replayed, segments) = (stats.replayed + stats.captured, stats.segments);
        eprintln!(
            "GRAPHS {what}, batch {lens:?}: {replayed} of {segments} segments of {steps} steps from graphs \
             ({} captured, {} eager, {} captures refused{}, {} ops issued past a step's recording), \
             max|Δ|/max|ref| = {worst:.2e}",
            stats.captured,
            stats.eager,
            stats.capture_failures,
            stats.capture_error.as_deref().map(|e| format!(": {e}")).unwrap_or_default(),
            stats.unrecorded
        );
        assert!(worst <= GRAPH_TOL, "{what}, batch {lens:?}: logits {worst:.3e} off the eager steps");
        assert_eq!(stats.recorded as usize, steps, "{what}: every decode step is recorded");
        assert_eq!(segments, replayed + stats.eager, "{what}: every segment is replayed or issued");
        assert!(
            4 * replayed >= 3 * segments,
            "{what}, batch {lens:?}: only {replayed} of {segments} segments replayed"
        );
        // A step's logits are its one read back, at its end: every op before it is
        // recorded (the cuBLAS products of the twelve-row batch included).
        assert_eq!(stats.unrecorded, 0, "{what}, batch {lens:?}: ops issued outside the steps' recordings");
    }
}

/// The warpgroup attention (`attention_wg`: V4's 64 heads of 512 dims, bf16 activations,
/// sm_90) inside captured steps: the `flash-bench` preset has V4-Flash's attention widths;
/// sixteen sequences decode in batches of 16 rows, which take it (from 16 rows by default,
/// `SLUICE_CUDA_ATT_WG_FROM`; prefills of 64 tokens and more take it whatever that says).
/// On other GPUs the same comparison runs `attention_mma`.
#[test]
fn cuda_graph_steps_match_eager_steps_at_flash_attention_widths() {
    let test = "cuda_graph_steps_match_eager_steps_at_flash_attention_widths";
    let _one = one_at_a_time();
    let (Some(with), Some(without)) = (gpu_in(test, Activations::Bf16), gpu_in(test, Activations::Bf16)) else {
        return;
    };
    without.set_graphs(false);
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    write_checkpoint(&model, &InitOptions::new(Preset::FlashBench, 5, WeightDtype::Bf16)).unwrap();
    let opts = EngineOptions { kv_dtype: EntryDtype::Fp8, max_pages: 96, max_sequences: 16, max_chunk_tokens: 512 };
    let g = Engine::load(&model, with, opts.clone()).unwrap();
    let e = Engine::load(&model, without, opts).unwrap();
    let lens = vec![70, 65, 130, 90, 66, 200, 75, 80, 64, 99, 150, 71, 68, 300, 77, 88];
    cases_match(&format!("{test} (BF16 weights, fp8 KV, bf16 activations)"), g, e, vec![(lens, 24)]);
}

/// Steps that overflow their arena (pinned at 64 KiB: a twelve-row step's logits alone
/// take more) issue what they recorded at the overflow and run the rest eagerly, so the
/// pool memory taken instead is freed after the launches that use it: the tokens and
/// logits are the eager engine's. (Until 2026-11-30 the rest stayed recorded while its
/// pool buffers were freed at once — a use after free, which the pool could hand to the
/// next buffer of the same segment.)
#[test]
fn cuda_graph_steps_that_overflow_their_arena_match_eager_steps() {
    let test = "cuda_graph_steps_that_overflow_their_arena_match_eager_steps";
    let _one = one_at_a_time();
    let (Some(with), Some(without)) = (gpu(test), gpu(test)) else { return };
    without.set_graphs(false);
    with.pin_step_arena(64 << 10);
    let (_dir, model) = small_checkpoint(WeightDtype::Bf16);
    let opts = EngineOptions { max_sequences: 12, ..fp8_options() };
    let mut g = Engine::load(&model, with, opts.clone()).unwrap();
    let mut e = Engine::load(&model, without, opts).unwrap();
    for (lens, steps) in [(vec![250], 40), (vec![5, 17, 30, 41, 52, 60, 66, 71, 24, 9, 45, 38], 24)] {
        g.model.backend.take_graph_stats();
        let got = decode(&mut g, &lens, steps);
        let stats = g.model.backend.take_graph_stats();
        let want = decode(&mut e, &lens, steps);
        let what = format!("{test}, batch {lens:?}");
        let worst = worst_row_error(&got, &want, &what);
        eprintln!(
            "GRAPHS {what}: {} steps recorded, {} segments issued eagerly, {} replayed, max|Δ|/max|ref| = {worst:.2e}",
            stats.recorded,
            stats.eager,
            stats.replayed + stats.captured
        );
        assert!(worst <= GRAPH_TOL, "{what}: logits {worst:.3e} off the eager steps");
        assert_eq!(stats.recorded as usize, steps, "{what}: every decode step is recorded");
        assert_eq!(stats.unrecorded, 0, "{what}: ops past a recording other than an overflow's");
        if lens.len() > 1 {
            assert!(stats.eager > 0, "{what}: the steps did not overflow their 64 KiB arena");
        }
    }
}

#[test]
fn cuda_graph_steps_match_eager_steps() {
    graphs_match_eager("cuda_graph_steps_match_eager_steps", WeightDtype::Bf16, EntryDtype::Bf16);
}

#[test]
fn cuda_graph_steps_match_eager_steps_fp8() {
    let test = "cuda_graph_steps_match_eager_steps_fp8";
    graphs_match_eager(test, WeightDtype::Fp8, EntryDtype::Fp8);
}

/// Greedy tokens picked on the device are the host sampler's on the same logits, their
/// log-probabilities agree to f32 rounding, and logits come back only where asked for.
#[test]
fn cuda_greedy_readout_matches_the_host_pick() {
    let test = "cuda_greedy_readout_matches_the_host_pick";
    let _one = one_at_a_time();
    let Some(b) = gpu(test) else { return };
    let (_dir, model) = small_checkpoint(WeightDtype::Fp8);
    let opts = fp8_options();
    let mut e = Engine::load(&model, b, opts).unwrap();
    let vocab = e.config().vocab_size;
    let mut seqs: Vec<_> = (0..3).map(|_| e.open_sequence().unwrap()).collect();
    let mut next = Vec::new();
    for (i, s) in seqs.iter_mut().enumerate() {
        let last = e.prefill(s, &prompt(40 + 90 * i, vocab, 7 + i as u64), Logits::Last).unwrap();
        next.push(argmax(&last));
    }
    let mut worst = 0f32;
    for step in 0..12 {
        let flags = if step % 3 == 2 { vec![false, true, false] } else { vec![true; 3] };
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let out = e.decode_readout(&mut refs, &next, &flags).unwrap();
        for (i, r) in out.iter().enumerate() {
            assert_eq!(r.logits.is_some(), flags[i], "step {step} row {i}: logits only where asked");
            if let Some(l) = &r.logits {
                let (token, logprob) = kernels::backend::greedy_pick(l);
                assert_eq!(r.token, token, "step {step} row {i}: device and host greedy tokens");
                let err = (r.logprob - logprob).abs() / logprob.abs().max(1.0);
                worst = worst.max(err);
                assert!(err <= 1e-6, "step {step} row {i}: logprob {} against the host's {logprob}", r.logprob);
            }
        }
        next = out.iter().map(|r| r.token).collect();
    }
    eprintln!("READOUT {test}: 12 steps of 3 rows, logprob within {worst:.2e} of the host's");
    for s in seqs {
        e.release(s);
    }
}

/// A sharded step (two ranks: on both GPUs of a two-GPU machine, and on one GPU twice)
/// replays its segments between the exchanges as graphs on every rank, and gives what the
/// same steps issued eagerly give.
#[test]
fn cuda_sharded_graph_steps_match_eager_steps() {
    let test = "cuda_sharded_graph_steps_match_eager_steps";
    let _one = one_at_a_time();
    let Some(one) = gpu(test) else { return };
    drop(one);
    let (_dir, model) = small_checkpoint(WeightDtype::Fp8);
    let opts = fp8_options();
    let mut layouts = vec![vec![0usize, 0]];
    if CudaBackend::device_count() >= 2 {
        layouts.push(vec![0, 1]);
    } else {
        eprintln!("{test}: one GPU, so the two-GPU layout is SKIPPED");
    }
    for ordinals in layouts {
        let with = engine::device::cuda_sharded_in(&ordinals, Activations::Split).unwrap();
        let without = engine::device::cuda_sharded_in(&ordinals, Activations::Split).unwrap();
        without.devices().iter().for_each(|d| d.set_graphs(false));
        let mut g = Engine::load(&model, with, opts.clone()).unwrap();
        let mut e = Engine::load(&model, without, opts.clone()).unwrap();
        let lens = [300, 41, 130, 7];
        let steps = 40;
        for d in g.model.backend.devices() {
            let _ = d.take_graph_stats();
        }
        let got = decode(&mut g, &lens, steps);
        let stats: Vec<_> = g.model.backend.devices().iter().map(|d| d.take_graph_stats()).collect();
        let want = decode(&mut e, &lens, steps);
        let worst = worst_row_error(&got, &want, &format!("ranks on cuda {ordinals:?}"));
        for (r, s) in stats.iter().enumerate() {
            let replayed = s.replayed + s.captured;
            eprintln!(
                "GRAPHS {test}, ranks on cuda {ordinals:?}, rank {r}: {replayed} of {} segments of {steps} steps \
                 from graphs ({} captured, {} eager), max|Δ|/max|ref| = {worst:.2e}",
                s.segments, s.captured, s.eager
            );
            assert_eq!(s.recorded as usize, steps, "rank {r}: every decode step is recorded");
            assert!(2 * replayed >= s.segments, "rank {r}: only {replayed} of {} segments replayed", s.segments);
        }
        assert!(worst <= GRAPH_TOL, "ranks on cuda {ordinals:?}: logits {worst:.3e} off the eager steps");
    }
}

/// Engines on several threads of one process, all on GPU 0 (one primary context), record
/// and capture their decode steps while the others prefill and decode, as
/// `cuda_conformance`'s parallel tests do: every thread's logits are the first thread's
/// (one checkpoint, the same prompts), and no capture is refused. Without
/// `kernels/src/cuda/capture_lock.rs` another thread's cuBLAS call or pinned allocation
/// synchronized the context mid-capture: captures were refused and the driver crashed now
/// and then (`SLUICE_CUDA_CAPTURE_LOCK=0` brings that back, for `tools/bench/crash_loop.sh`).
#[test]
fn cuda_engines_on_many_threads_capture_at_once() {
    const THREADS: usize = 6;
    let test = "cuda_engines_on_many_threads_capture_at_once";
    let _one = one_at_a_time();
    let Some(first) = gpu(test) else { return };
    drop(first);
    let (_dir, model) = small_checkpoint(WeightDtype::Fp8);
    let opts = fp8_options();
    // Every engine loads before any decodes, so that the captures meet the other threads'
    // prefills and decode steps (cuBLAS's first uses, pinned read buffers): the case
    // `cuda_conformance` hit.
    let loaded = std::sync::Barrier::new(THREADS);
    let results: Vec<_> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    let b = gpu(test).expect("GPU 0 was there a moment ago");
                    let mut e = Engine::load(&model, b, opts.clone()).unwrap();
                    loaded.wait();
                    e.model.backend.take_graph_stats();
                    let logits = [(vec![250], 40), (vec![700, 261, 5], 24), (vec![90, 31], 30)]
                        .into_iter()
                        .flat_map(|(lens, steps)| decode(&mut e, &lens, steps))
                        .collect::<Vec<_>>();
                    (logits, e.model.backend.take_graph_stats())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a decoding thread panicked")).collect()
    });
    let (want, _) = &results[0];
    for (i, (got, stats)) in results.iter().enumerate() {
        let replayed = stats.replayed + stats.captured;
        eprintln!(
            "GRAPHS {test}, thread {i}: {replayed} of {} segments from graphs ({} captured, {} captures refused{})",
            stats.segments,
            stats.captured,
            stats.capture_failures,
            stats.capture_error.as_deref().map(|e| format!(": {e}")).unwrap_or_default()
        );
        assert_eq!(stats.capture_failures, 0, "thread {i}: a capture was refused");
        assert!(
            4 * replayed >= 3 * stats.segments,
            "thread {i}: only {replayed} of {} segments replayed",
            stats.segments
        );
        let worst = worst_row_error(got, want, &format!("thread {i} against thread 0"));
        assert!(worst <= GRAPH_TOL, "thread {i}: logits {worst:.3e} off thread 0's");
    }
}
