//! The multi-device layout (kernels::sharded: data-parallel attention, expert-parallel
//! MoE) computes what one device computes. Run here with CPU "devices" and the host
//! collective, so CI checks the layout's logic without GPUs; the GPU runs of the same
//! checks are in cuda_conformance.rs. On the reference-checked fixture model: batched
//! prefill of sequences on different devices, uneven chunked prefill, batched decode of
//! mixed lengths, sequences moved between one device and several, and prefix restores
//! (snapshot and window rebuild) into a sharded engine from a cold run on one device.

use std::path::{Path, PathBuf};

use engine::kv::Sequence;
use engine::prefix::PrefixState;
use engine::{CpuBackend, Engine, EngineError, EngineOptions, EntryDtype, Logits, StepInput};
use kernels::sharded::{HostCollective, Sharded};

const BLOCK: usize = 128;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-official/model")
}

fn options(dtype: EntryDtype, ranks: usize) -> EngineOptions {
    EngineOptions { kv_dtype: dtype, max_pages: 24 * ranks, max_sequences: 3 * ranks, max_chunk_tokens: 4096 }
}

fn single(dtype: EntryDtype, ranks: usize) -> Engine<CpuBackend> {
    Engine::load(&model_dir(), CpuBackend::new(), options(dtype, ranks)).unwrap()
}

fn sharded(dtype: EntryDtype, ranks: usize) -> Engine<Sharded<CpuBackend>> {
    let backend = Sharded::new((0..ranks).map(|_| CpuBackend::new()).collect(), Box::new(HostCollective));
    Engine::load(&model_dir(), backend, options(dtype, ranks)).unwrap()
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(salt * 97) >> 7) % 160).collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
}

/// The MoE block sums each row's experts device by device, so sums agree to f32
/// rounding, not bit for bit.
const TOL: f32 = 1e-5;

/// Prefill `prompts` in one batched step, then decode `steps` greedy tokens for all of
/// them together; returns every logit vector produced, in order, and the tokens.
fn run<B: kernels::Backend>(e: &mut Engine<B>, prompts: &[Vec<u32>], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let vocab = e.config().vocab_size;
    let mut seqs: Vec<Sequence> = prompts.iter().map(|_| e.open_sequence().unwrap()).collect();
    let mut inputs: Vec<StepInput<'_>> =
        seqs.iter_mut().zip(prompts).map(|(seq, p)| StepInput { seq, tokens: p, logits: Logits::All }).collect();
    let mut logits = e.step(&mut inputs).unwrap();
    let mut next: Vec<u32> = logits.iter().map(|l| engine::sampling::argmax(&l[l.len() - vocab..])).collect();
    let mut tokens = next.clone();
    for _ in 0..steps {
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let l = e.decode(&mut refs, &next).unwrap();
        next = l.iter().map(|v| engine::sampling::argmax(v)).collect();
        tokens.extend(&next);
        logits.extend(l);
    }
    for s in seqs {
        e.release(s);
    }
    assert_eq!(e.pool_stats().pages_used, 0);
    (logits, tokens)
}

#[test]
fn sharded_engines_compute_what_one_device_computes() {
    let prompts = vec![prompt(300, 1), prompt(131, 2), prompt(517, 3), prompt(7, 4)];
    for dtype in [EntryDtype::F32, EntryDtype::Bf16] {
        let (want, want_tokens) = run(&mut single(dtype, 2), &prompts, 10);
        for ranks in [2, 3] {
            let mut e = sharded(dtype, ranks);
            let (got, tokens) = run(&mut e, &prompts, 10);
            assert_eq!(tokens, want_tokens, "{ranks} devices, {dtype:?}: greedy tokens differ");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let err = rel_err(g, w);
                assert!(err <= TOL, "{ranks} devices, {dtype:?}: logits {i} differ by {err:.2e}");
            }
        }
    }
}

/// A sharded engine's greedy read-out (each device picks its own rows) gives the tokens
/// and logprobs one device's gives, and the same logits where asked.
#[test]
fn sharded_greedy_readout_matches_one_device() {
    let prompts = [prompt(140, 1), prompt(33, 2), prompt(260, 3)];
    let mut one = single(EntryDtype::F32, 2);
    let mut two = sharded(EntryDtype::F32, 2);
    let mut seqs: Vec<(Sequence, Sequence)> = Vec::new();
    let mut next = Vec::new();
    for p in &prompts {
        let (mut a, mut b) = (one.open_sequence().unwrap(), two.open_sequence().unwrap());
        let l = one.prefill(&mut a, p, Logits::Last).unwrap();
        two.prefill(&mut b, p, Logits::Last).unwrap();
        next.push(engine::sampling::argmax(&l));
        seqs.push((a, b));
    }
    let flags = [false, true, false];
    for step in 0..4 {
        let (mut sa, mut sb): (Vec<&mut Sequence>, Vec<&mut Sequence>) = seqs.iter_mut().map(|(a, b)| (a, b)).unzip();
        let want = one.decode_readout(&mut sa, &next, &flags).unwrap();
        let got = two.decode_readout(&mut sb, &next, &flags).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.token, w.token, "step {step} row {i}");
            assert!((g.logprob - w.logprob).abs() <= TOL * w.logprob.abs().max(1.0), "step {step} row {i}");
            match (&g.logits, &w.logits) {
                (Some(g), Some(w)) => assert!(rel_err(g, w) <= TOL, "step {step} row {i}: logits"),
                (None, None) => {}
                _ => panic!("step {step} row {i}: logits returned where not asked, or missing"),
            }
        }
        next = want.iter().map(|r| r.token).collect();
    }
}

#[test]
fn sequences_spread_over_the_devices() {
    let mut e = sharded(EntryDtype::F32, 2);
    let mut a = e.open_sequence().unwrap();
    e.prefill(&mut a, &prompt(300, 1), Logits::None).unwrap();
    let b = e.open_sequence().unwrap();
    assert_eq!((e.cache.rank_of(&a), e.cache.rank_of(&b)), (0, 1), "the second sequence goes where pages are free");
    let per = e.pool_stats().pages_total / 2;
    assert!(a.pages().iter().all(|&p| (p as usize) < per), "pages on the device of the slot: {:?}", a.pages());
    e.release(a);
    e.release(b);
}

#[test]
fn chunked_prefill_on_a_sharded_engine_equals_one_shot() {
    let mut e = sharded(EntryDtype::F32, 2);
    let vocab = e.config().vocab_size;
    let p = prompt(517, 9);
    let mut one = e.open_sequence().unwrap();
    let want = e.prefill(&mut one, &p, Logits::All).unwrap();
    let mut seq = e.open_sequence().unwrap();
    assert_ne!(e.cache.rank_of(&one), e.cache.rank_of(&seq), "the two runs are on different devices");
    let mut got = Vec::new();
    let mut at = 0;
    for n in [1usize, 200, 77, 128, 111] {
        let chunk = &p[at..at + n];
        got.extend(e.step(&mut [StepInput { seq: &mut seq, tokens: chunk, logits: Logits::All }]).unwrap().remove(0));
        at += n;
    }
    assert_eq!(at, p.len());
    assert_eq!(got.len(), p.len() * vocab);
    let err = rel_err(&got, &want);
    assert!(err <= TOL, "chunked vs one-shot differ by {err:.2e}");
    e.release(one);
    e.release(seq);
}

#[test]
fn sequences_move_between_one_device_and_several() {
    let p = prompt(260, 5);
    let mut one = single(EntryDtype::Bf16, 2);
    let mut many = sharded(EntryDtype::Bf16, 2);
    // Fill device 0 of the sharded engine first, so the import lands on device 1.
    let mut filler = many.open_sequence().unwrap();
    many.prefill(&mut filler, &prompt(600, 6), Logits::None).unwrap();
    let mut s = one.open_sequence().unwrap();
    let last = one.prefill(&mut s, &p, Logits::Last).unwrap();
    let next = engine::sampling::argmax(&last);
    let mut moved = many.import(&one.export(&s)).unwrap();
    assert_eq!(many.cache.rank_of(&moved), 1);
    let want = one.decode(&mut [&mut s], &[next]).unwrap().remove(0);
    let got = many.decode(&mut [&mut moved], &[next]).unwrap().remove(0);
    assert!(rel_err(&got, &want) <= TOL, "decode after import differs");
    // And back: the sharded engine's export continues on one device.
    let mut back = one.import(&many.export(&moved)).unwrap();
    let t = engine::sampling::argmax(&got);
    let a = one.decode(&mut [&mut back], &[t]).unwrap().remove(0);
    let b = many.decode(&mut [&mut moved], &[t]).unwrap().remove(0);
    assert!(rel_err(&a, &b) <= TOL, "decode after the way back differs");
    one.release(s);
    one.release(back);
    many.release(moved);
    many.release(filler);
}

#[test]
fn prefixes_restore_into_a_sharded_engine() {
    let tokens = prompt(700, 8);
    let mut cold = single(EntryDtype::F32, 2);
    let vocab = cold.config().vocab_size;
    // The cold run on one device: its logits, and what a prefix cache keeps of it.
    let mut seq = cold.open_sequence().unwrap();
    let want = cold.prefill(&mut seq, &tokens, Logits::All).unwrap();
    cold.release(seq);
    let mut seq = cold.open_sequence().unwrap();
    let blocks = 4;
    cold.prefill(&mut seq, &tokens[..blocks * BLOCK], Logits::None).unwrap();
    let snapshot = cold.snapshot(&seq);
    let bytes = cold.sequence_bytes(&seq, seq.len()).expect("host memory");
    let pages: Vec<Vec<u8>> = bytes.pages.iter().map(|p| p.to_vec()).collect();
    cold.release(seq);

    let mut e = sharded(EntryDtype::F32, 2);
    for (state, filler) in [(PrefixState::Snapshot, false), (PrefixState::Rebuild, true)] {
        // With a sequence already on device 0, the restore lands on device 1.
        let mut other = e.open_sequence().unwrap();
        if filler {
            e.prefill(&mut other, &prompt(300, 1), Logits::None).unwrap();
        }
        let mut s = e.open_sequence().unwrap();
        e.reserve_prefix(&mut s, blocks).unwrap();
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        e.write_pages(&s, &refs).unwrap();
        if state == PrefixState::Snapshot {
            e.write_snapshot(&s, &snapshot).unwrap();
        }
        e.finish_restore(&mut s, &tokens[..blocks * BLOCK], state).unwrap();
        let rest = e
            .step(&mut [StepInput { seq: &mut s, tokens: &tokens[blocks * BLOCK..], logits: Logits::All }])
            .unwrap()
            .remove(0);
        let err = rel_err(&rest, &want[blocks * BLOCK * vocab..]);
        assert!(
            err <= 1e-4,
            "{state:?} (device {}): logits after the restore differ by {err:.2e}",
            e.cache.rank_of(&s)
        );
        e.release(s);
        e.release(other);
    }
}

#[test]
fn pools_that_do_not_divide_are_refused_before_loading() {
    let backend = Sharded::new(vec![CpuBackend::new(), CpuBackend::new()], Box::new(HostCollective));
    let opts = EngineOptions { kv_dtype: EntryDtype::F32, max_pages: 25, max_sequences: 4, max_chunk_tokens: 64 };
    let err = match Engine::load(&model_dir(), backend, opts) {
        Err(e @ EngineError::Pools(_)) => e.to_string(),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("25 pages over 2 devices were accepted"),
    };
    assert!(err.contains("multiples of 2"), "{err}");
}
