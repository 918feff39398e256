//! Conformance against the reference (HF transformers' DeepseekV4ForCausalLM): the
//! fixtures under tests/golden were written by tools/golden/generate.py. For every
//! case: one-shot prefill, the fixture's uneven chunked prefill and token-by-token
//! prefill must all match the reference logits (max|Δ| / max|ref| ≤ 1e-4), and greedy
//! decoding must produce the reference tokens with matching logits at every step.
//!
//! With fp8 KV entries (the serving format) every fixture must decode the same greedy
//! tokens as bf16 KV (up to bf16's own near-ties, `FP8_TIE`), with logits within
//! `FP8_TOL` of the reference in one-shot, chunked and token-by-token prefill and at
//! every decode step on the reference's path.

use std::path::{Path, PathBuf};

use engine::{CpuBackend, Engine, EngineOptions, EntryDtype, Logits};
use safetensors::SafeTensors;
use serde_json::Value;

const TOL: f32 = 1e-4;
/// fp8 KV against the reference. The fixtures are random tiny models (head_dim 32, 16
/// FP8 dims an entry) whose logits swing with every MoE and indexer choice a perturbed
/// entry flips: bf16 KV alone is 0.78 max|Δ|/max|ref| off on tiny-official. Measured
/// with fp8 KV over every fixture, case and prefill mode and the decode steps on the
/// reference's path: 0.77 (prefill alone 0.61; see docs/engine.md).
const FP8_TOL: f32 = 0.8;
/// Greedy paths of fp8 and bf16 KV may part only where bf16's own choice was a near-tie:
/// its top two logits within this fraction of the row's largest |logit| (measured: the
/// widest such margin where they parted is 8.6%; the first token never differs).
const FP8_TIE: f32 = 0.1;
/// fp8 KV, chunked or token-by-token prefill against one-shot: the same stored values,
/// f32 sums in other batch shapes, so the f32 bound (measured: 3.9e-5).
const FP8_CHUNKED_TOL: f32 = 1e-4;

struct Case {
    prompt: Vec<u32>,
    chunks: Vec<usize>,
    greedy: Vec<u32>,
    prefill: Vec<f32>,
    decode: Vec<f32>,
}

fn golden_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name)
}

fn load(name: &str, model: &str, kv_dtype: EntryDtype) -> (Engine<CpuBackend>, Vec<Case>) {
    let dir = golden_dir(name);
    let opts = EngineOptions { kv_dtype, max_pages: 64, max_sequences: 4, max_chunk_tokens: 4096 };
    let engine = Engine::load(&dir.join(model), CpuBackend::new(), opts).expect("load fixture model");
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let floats = |n: &str| -> Vec<f32> {
        st.tensor(n).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    let cases = meta["cases"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| Case {
            prompt: ids(&c["prompt"]),
            chunks: ids(&c["chunks"]).into_iter().map(|x| x as usize).collect(),
            greedy: ids(&c["greedy_tokens"]),
            prefill: floats(&format!("case{i}.prefill")),
            decode: floats(&format!("case{i}.decode")),
        })
        .collect();
    (engine, cases)
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max) / scale
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0 as u32
}

fn check(name: &str, what: &str, got: &[f32], want: &[f32]) {
    check_tol(name, what, got, want, TOL);
}

fn check_tol(name: &str, what: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    let e = rel_err(got, want);
    if std::env::var_os("SLUICE_SHOW_ERR").is_some() {
        eprintln!("{name} {what}: {e:.2e}");
    }
    assert!(e <= tol, "{name} {what}: max|Δ|/max|ref| = {e:.3e} > {tol:.0e}");
    e
}

/// Prefill `prompt` in `chunks`, then decode `steps` greedy tokens; returns the prefill
/// logits, the tokens and each decode step's logits.
fn prefill_and_decode(
    engine: &mut Engine<CpuBackend>,
    prompt: &[u32],
    chunks: &[usize],
    steps: usize,
) -> (Vec<f32>, Vec<u32>, Vec<Vec<f32>>) {
    let vocab = engine.config().vocab_size;
    let mut seq = engine.open_sequence().unwrap();
    let mut prefill = Vec::new();
    let mut at = 0;
    for &c in chunks {
        prefill.extend(engine.prefill(&mut seq, &prompt[at..at + c], Logits::All).unwrap());
        at += c;
    }
    let mut next = argmax(&prefill[prefill.len() - vocab..]);
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        tokens.push(next);
        let l = engine.decode(&mut [&mut seq], &[next]).unwrap().remove(0);
        next = argmax(&l);
        logits.push(l);
    }
    engine.release(seq);
    (prefill, tokens, logits)
}

/// fp8 KV on one fixture: one-shot, chunked and token-by-token prefill and the decode
/// steps on the reference's path within FP8_TOL of the reference; the first greedy token
/// identical to bf16 KV's, and later ones too except where bf16's own choice was a
/// near-tie (FP8_TIE): there the paths may part, and the rest of that case is not compared.
fn run_fixture_fp8(name: &str, model: &str) {
    let (mut fp8, cases) = load(name, model, EntryDtype::Fp8);
    let (mut bf16, _) = load(name, model, EntryDtype::Bf16);
    let vocab = fp8.config().vocab_size;
    let (mut worst, mut ties, mut identical) = (0f32, 0, 0);
    for (i, case) in cases.iter().enumerate() {
        let what = |s: &str| format!("fp8 KV case {i} (length {}) {s}", case.prompt.len());
        let steps = case.greedy.len();
        let one = [case.prompt.len()];
        let (one_shot, _, _) = prefill_and_decode(&mut fp8, &case.prompt, &one, 0);
        worst = worst.max(check_tol(name, &what("one-shot prefill"), &one_shot, &case.prefill, FP8_TOL));
        let (chunked, tokens, decode) = prefill_and_decode(&mut fp8, &case.prompt, &case.chunks, steps);
        worst = worst.max(check_tol(name, &what("chunked prefill"), &chunked, &case.prefill, FP8_TOL));
        // Every token attends to the same stored values however the prompt is cut.
        check_tol(name, &what("chunked vs one-shot prefill"), &chunked, &one_shot, FP8_CHUNKED_TOL);
        let (bf16_prefill, bf16_tokens, bf16_decode) = prefill_and_decode(&mut bf16, &case.prompt, &case.chunks, steps);
        // The logits row each bf16 token was chosen from.
        let chose =
            std::iter::once(&bf16_prefill[bf16_prefill.len() - vocab..]).chain(bf16_decode.iter().map(|l| &l[..]));
        let mut same = true;
        for (step, ((t, b), row)) in tokens.iter().zip(&bf16_tokens).zip(chose).enumerate() {
            if t != b {
                let (top, second) = top_two(row);
                let bound = FP8_TIE * row.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(step > 0, "{name} {}: the first greedy token is {t}, bf16 KV's {b}", what(""));
                assert!(
                    top - second <= bound,
                    "{name} {}: greedy token {step} is {t}, bf16 KV's {b} won by {:.3e} (> the fp8 bound {bound:.3e})",
                    what(""),
                    top - second
                );
                ties += 1;
                same = false;
                break;
            }
        }
        identical += usize::from(same);
        for (step, l) in decode.iter().enumerate() {
            if tokens[..=step] != case.greedy[..=step] {
                break;
            }
            let want = &case.decode[step * vocab..(step + 1) * vocab];
            worst = worst.max(check_tol(name, &what(&format!("decode step {step}")), l, want, FP8_TOL));
        }
        let n = case.prompt.len().min(140);
        let singles = vec![1; n];
        let (single, _, _) = prefill_and_decode(&mut fp8, &case.prompt[..n], &singles, 0);
        worst = worst.max(check_tol(name, &what("token-by-token"), &single, &case.prefill[..n * vocab], FP8_TOL));
        check_tol(name, &what("token-by-token vs one-shot"), &single, &one_shot[..n * vocab], FP8_CHUNKED_TOL);
    }
    eprintln!(
        "{name}/{model}: fp8 KV max|Δ|/max|ref| {worst:.2e}; {identical} of {} cases decode bf16 KV's tokens, \
         {ties} part at a bf16 near-tie",
        cases.len()
    );
    let stats = fp8.pool_stats();
    assert_eq!((stats.pages_used, stats.slots_used), (0, 0), "{name}: pages or slots leaked");
}

/// The largest and second-largest values of a row.
fn top_two(row: &[f32]) -> (f32, f32) {
    row.iter().fold((f32::NEG_INFINITY, f32::NEG_INFINITY), |(a, b), &v| if v > a { (v, a) } else { (a, b.max(v)) })
}

fn run_fixture(name: &str, model: &str) {
    let (mut engine, cases) = load(name, model, EntryDtype::F32);
    let vocab = engine.config().vocab_size;
    for (i, case) in cases.iter().enumerate() {
        let what = |s: &str| format!("case {i} (length {}) {s}", case.prompt.len());

        // One-shot prefill.
        let mut seq = engine.open_sequence().unwrap();
        let one_shot = engine.prefill(&mut seq, &case.prompt, Logits::All).unwrap();
        check(name, &what("one-shot prefill"), &one_shot, &case.prefill);
        engine.release(seq);

        // The last row's logits alone (the last layer's residual update then runs for
        // that row only).
        let mut seq = engine.open_sequence().unwrap();
        let last = engine.prefill(&mut seq, &case.prompt, Logits::Last).unwrap();
        check(name, &what("prefill, last row only"), &last, &case.prefill[case.prefill.len() - vocab..]);
        engine.release(seq);

        // The fixture's uneven chunks, then greedy decoding from that state.
        let mut seq = engine.open_sequence().unwrap();
        let mut chunked = Vec::new();
        let mut at = 0;
        for &c in &case.chunks {
            chunked.extend(engine.prefill(&mut seq, &case.prompt[at..at + c], Logits::All).unwrap());
            at += c;
        }
        check(name, &what(&format!("chunked prefill {:?}", case.chunks)), &chunked, &case.prefill);
        let mut next = argmax(&chunked[chunked.len() - vocab..]);
        for (step, &want_tok) in case.greedy.iter().enumerate() {
            assert_eq!(next, want_tok, "{name} {}: greedy token {step}", what(""));
            let logits = engine.decode(&mut [&mut seq], &[next]).unwrap().remove(0);
            check(name, &what(&format!("decode step {step}")), &logits, &case.decode[step * vocab..(step + 1) * vocab]);
            next = argmax(&logits);
        }
        engine.release(seq);

        // Token by token (every prompt up to 129 tokens, and the first 140 of longer ones).
        let n = case.prompt.len().min(140);
        let mut seq = engine.open_sequence().unwrap();
        let mut single = Vec::new();
        for t in &case.prompt[..n] {
            single.extend(engine.prefill(&mut seq, std::slice::from_ref(t), Logits::All).unwrap());
        }
        check(name, &what("token-by-token"), &single, &case.prefill[..n * vocab]);
        engine.release(seq);
    }
    let stats = engine.pool_stats();
    assert_eq!((stats.pages_used, stats.slots_used), (0, 0), "{name}: pages or slots leaked");
}

#[test]
fn tiny_official_layout_f32() {
    run_fixture("tiny-official", "model");
}

#[test]
fn tiny_hf_layout() {
    run_fixture("tiny-hf", "model");
}

#[test]
fn tiny_transformers_save_pretrained_layout() {
    run_fixture("tiny-hf", "model-saved");
}

#[test]
fn tiny_quantised_fp8_fp4_sharded() {
    run_fixture("tiny-quant", "model");
}

#[test]
fn tiny_preset_written_by_sluice_model_init() {
    run_fixture("tiny-init", "model");
}

#[test]
fn fp8_kv_tiny_official_layout() {
    run_fixture_fp8("tiny-official", "model");
}

#[test]
fn fp8_kv_tiny_hf_layout() {
    run_fixture_fp8("tiny-hf", "model");
}

#[test]
fn fp8_kv_tiny_transformers_save_pretrained_layout() {
    run_fixture_fp8("tiny-hf", "model-saved");
}

#[test]
fn fp8_kv_tiny_quantised_fp8_fp4_sharded() {
    run_fixture_fp8("tiny-quant", "model");
}

#[test]
fn fp8_kv_tiny_preset_written_by_sluice_model_init() {
    run_fixture_fp8("tiny-init", "model");
}
