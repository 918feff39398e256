//! Resuming a sequence from a prefix cache reproduces the cold run: pages plus a
//! snapshot at the hit point (`full`), pages plus an older snapshot and the gap
//! recomputed (`periodic`), and pages alone with the window rebuilt (`zero`), on the
//! reference-checked fixture model, for prefixes shorter and longer than the window
//! stack (window × layers), under f32, bf16 and fp8 KV storage.

use std::path::{Path, PathBuf};

use engine::prefix::PrefixState;
use engine::{CpuBackend, Engine, EngineOptions, EntryDtype, Logits, StepInput};

const BLOCK: usize = 128;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-official/model")
}

fn engine(dtype: EntryDtype) -> Engine<CpuBackend> {
    let opts = EngineOptions { kv_dtype: dtype, max_pages: 64, max_sequences: 4, max_chunk_tokens: 4096 };
    Engine::load(&model_dir(), CpuBackend::new(), opts).unwrap()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i.wrapping_mul(2654435761) >> 9) % 160).collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
}

/// What a prefix cache would hold after a cold prefill: each block's page and the
/// snapshot at each block boundary, plus the cold run's logits for every position.
struct Cold {
    pages: Vec<Vec<u8>>,
    snapshots: Vec<Vec<u8>>, // snapshots[k - 1] = state after k blocks
    logits: Vec<f32>,
    decoded: Vec<(u32, Vec<f32>)>,
}

const DECODE_STEPS: usize = 8;

fn cold_run(e: &mut Engine<CpuBackend>, tokens: &[u32]) -> Cold {
    let vocab = e.config().vocab_size;
    // One-shot prefill: the reference logits.
    let mut one = e.open_sequence().unwrap();
    let logits = e.prefill(&mut one, tokens, Logits::All).unwrap();
    let decoded = greedy(e, &mut one, &logits[logits.len() - vocab..]);
    e.release(one);
    // The same prompt block by block, as a prefill worker storing snapshots runs it.
    let mut seq = e.open_sequence().unwrap();
    let mut snapshots = Vec::new();
    for chunk in tokens.chunks(BLOCK) {
        e.step(&mut [StepInput { seq: &mut seq, tokens: chunk, logits: Logits::None }]).unwrap();
        if seq.len().is_multiple_of(BLOCK) {
            snapshots.push(e.snapshot(&seq));
        }
    }
    let bytes = e.sequence_bytes(&seq, seq.len()).expect("host memory");
    let pages = bytes.pages.iter().map(|p| p.to_vec()).collect();
    e.release(seq);
    Cold { pages, snapshots, logits, decoded }
}

fn greedy(e: &mut Engine<CpuBackend>, seq: &mut engine::kv::Sequence, last: &[f32]) -> Vec<(u32, Vec<f32>)> {
    let mut out = Vec::new();
    let mut next = engine::sampling::argmax(last);
    for _ in 0..DECODE_STEPS {
        let l = e.decode(&mut [seq], &[next]).unwrap().remove(0);
        out.push((next, l.clone()));
        next = engine::sampling::argmax(&l);
    }
    out
}

/// Restore `blocks` cached pages (with the snapshot at `snapshot_at` blocks, or a
/// rebuild), prefill the rest of the prompt, and compare with the cold run.
fn check_restore(e: &mut Engine<CpuBackend>, tokens: &[u32], cold: &Cold, blocks: usize, state: PrefixState, tol: f32) {
    let vocab = e.config().vocab_size;
    let what = format!("{blocks} blocks, {state:?}, {} tokens, {:?}", tokens.len(), e.options.kv_dtype);
    let mut seq = e.open_sequence().unwrap();
    let ids = e.reserve_prefix(&mut seq, blocks).unwrap();
    assert_eq!(ids.len(), blocks);
    let pages: Vec<&[u8]> = cold.pages[..blocks].iter().map(Vec::as_slice).collect();
    e.write_pages(&seq, &pages).unwrap();
    if state == PrefixState::Snapshot {
        e.write_snapshot(&seq, &cold.snapshots[blocks - 1]).unwrap();
    }
    let prefix = blocks * BLOCK;
    let work = e.finish_restore(&mut seq, &tokens[..prefix], state).unwrap();
    match state {
        PrefixState::Snapshot => assert_eq!(work, 0),
        PrefixState::Rebuild => {
            let bound = model_spec::RestorePlan::rebuild_cost(prefix, 128, e.config().num_layers);
            assert_eq!(work, bound, "{what}: the rebuild computes exactly what the windows need");
        }
    }
    assert_eq!(seq.len(), prefix);
    // Uneven chunks after the restore, as a token budget would cut them.
    let rest = &tokens[prefix..];
    let mut logits = Vec::new();
    for chunk in rest.chunks(77) {
        logits
            .extend(e.step(&mut [StepInput { seq: &mut seq, tokens: chunk, logits: Logits::All }]).unwrap().remove(0));
    }
    let want = &cold.logits[prefix * vocab..];
    let err = rel_err(&logits, want);
    assert!(err <= tol, "{what}: prefill logits differ from the cold run by {err:.2e}");
    let decoded = greedy(e, &mut seq, &logits[logits.len() - vocab..]);
    for (step, ((t, l), (ct, cl))) in decoded.iter().zip(&cold.decoded).enumerate() {
        assert_eq!(t, ct, "{what}: greedy token {step} differs");
        let err = rel_err(l, cl);
        assert!(err <= tol, "{what}: decode step {step} logits differ by {err:.2e}");
    }
    e.release(seq);
    assert_eq!(e.pool_stats().pages_used, 0);
}

#[test]
fn every_restore_reproduces_the_cold_run() {
    // The fixture has 4 layers: its window stack is 512 tokens, so a 7-block prefix
    // rebuilds only the last 512 positions at layer 0, a 2-block one all of them.
    for dtype in [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8] {
        let mut e = engine(dtype);
        // The restored run computes the rest of the prompt in other batch shapes than the
        // cold one-shot prefill, so f32 sums agree to rounding, not bit for bit (fp8
        // included: observed 6.6e-7; the restored KV bytes themselves are the cold run's).
        let tol = 1e-4;
        for len in [900usize, 897, 300] {
            let tokens = prompt(len);
            let cold = cold_run(&mut e, &tokens);
            let n = model_spec::prefix::restorable_blocks(len, BLOCK);
            // full: the snapshot at the hit point.
            check_restore(&mut e, &tokens, &cold, n, PrefixState::Snapshot, tol);
            // periodic: an older snapshot; the gap is recomputed by the prefill.
            check_restore(&mut e, &tokens, &cold, 1, PrefixState::Snapshot, tol);
            // zero: pages only, the window rebuilt.
            check_restore(&mut e, &tokens, &cold, n, PrefixState::Rebuild, tol);
            if n > 2 {
                check_restore(&mut e, &tokens, &cold, 2, PrefixState::Rebuild, tol);
            }
        }
    }
}

#[test]
fn restores_refuse_what_they_cannot_do() {
    let mut e = engine(EntryDtype::F32);
    let tokens = prompt(400);
    let mut busy = e.open_sequence().unwrap();
    e.prefill(&mut busy, &tokens[..10], Logits::None).unwrap();
    assert!(e.reserve_prefix(&mut busy, 1).is_err(), "only into an empty sequence");
    e.release(busy);

    let mut seq = e.open_sequence().unwrap();
    e.reserve_prefix(&mut seq, 2).unwrap();
    let err = e.write_snapshot(&seq, &[0u8; 3]).unwrap_err().to_string();
    assert!(err.contains("snapshot of 3 bytes"), "{err}");
    let err = e.write_pages(&seq, &[&[0u8; 5]]).unwrap_err().to_string();
    assert!(err.contains("page of 5 bytes"), "{err}");
    let err = e.finish_restore(&mut seq, &tokens[..200], PrefixState::Rebuild).unwrap_err().to_string();
    assert!(err.contains("whole blocks"), "{err}");
    let err = e.finish_restore(&mut seq, &tokens[..3 * BLOCK], PrefixState::Rebuild).unwrap_err().to_string();
    assert!(err.contains("2 pages"), "{err}");
    assert!(seq.is_empty(), "failed restores leave the sequence empty");
    e.release(seq);
    assert_eq!(e.pool_stats().pages_used, 0);
}
