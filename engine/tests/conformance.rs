//! Conformance against the reference (HF transformers' DeepseekV4ForCausalLM): the
//! fixtures under tests/golden were written by tools/golden/generate.py. For every
//! case: one-shot prefill, the fixture's uneven chunked prefill and token-by-token
//! prefill must all match the reference logits (max|Δ| / max|ref| ≤ 1e-4), and greedy
//! decoding must produce the reference tokens with matching logits at every step.

use std::path::{Path, PathBuf};

use engine::{CpuBackend, Engine, EngineOptions, EntryDtype, Logits};
use safetensors::SafeTensors;
use serde_json::Value;

const TOL: f32 = 1e-4;

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

fn load(name: &str, model: &str) -> (Engine<CpuBackend>, Vec<Case>) {
    let dir = golden_dir(name);
    let opts = EngineOptions { kv_dtype: EntryDtype::F32, max_pages: 64, max_sequences: 4, max_chunk_tokens: 4096 };
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
    let e = rel_err(got, want);
    if std::env::var_os("SLUICE_SHOW_ERR").is_some() {
        eprintln!("{name} {what}: {e:.2e}");
    }
    assert!(e <= TOL, "{name} {what}: max|Δ|/max|ref| = {e:.3e} > {TOL:.0e}");
}

fn run_fixture(name: &str, model: &str) {
    let (mut engine, cases) = load(name, model);
    let vocab = engine.config().vocab_size;
    for (i, case) in cases.iter().enumerate() {
        let what = |s: &str| format!("case {i} (length {}) {s}", case.prompt.len());

        // One-shot prefill.
        let mut seq = engine.open_sequence().unwrap();
        let one_shot = engine.prefill(&mut seq, &case.prompt, Logits::All).unwrap();
        check(name, &what("one-shot prefill"), &one_shot, &case.prefill);
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
