//! Checkpoint loading errors name what is wrong, and `model init` writes
//! deterministic checkpoints the loader accepts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use engine::checkpoint::{OwnedTensor, write_safetensors};
use engine::generate::{GenerateRequest, generate};
use engine::init::{InitOptions, Preset, WeightDtype, write_checkpoint};
use engine::sampling::SamplingParams;
use engine::{CpuBackend, Engine, EngineOptions};
use safetensors::{Dtype, SafeTensors};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-official/model")
}

/// A copy of the fixture model with its tensors edited by `edit`.
fn edited(edit: impl FnOnce(&mut HashMap<String, OwnedTensor>)) -> tempfile::TempDir {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, OwnedTensor> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, OwnedTensor { dtype: v.dtype(), shape: v.shape().to_vec(), data: v.data().to_vec() }))
        .collect();
    edit(&mut tensors);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture().join("config.json"), dir.path().join("config.json")).unwrap();
    let mut tensors: Vec<(String, OwnedTensor)> = tensors.into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    write_safetensors(&dir.path().join("model.safetensors"), &tensors).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    match Engine::load(dir, CpuBackend::new(), EngineOptions::default()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let dir = edited(|t| drop(t.remove("layers.1.attn.indexer.wq_b.weight")));
    let msg = load_err(dir.path());
    assert!(msg.contains("missing tensor `layers.1.attn.indexer.wq_b.weight`"), "{msg}");
}

#[test]
fn misshaped_tensor_names_expected_and_actual_shape() {
    let dir = edited(|t| {
        let w = t.get_mut("layers.2.attn.wq_a.weight").unwrap();
        w.shape = vec![w.shape[1], w.shape[0]]; // [32, 64] stored as [64, 32]
    });
    let msg = load_err(dir.path());
    assert!(msg.contains("`layers.2.attn.wq_a.weight` has shape [64, 32], expected [32, 64]"), "{msg}");
}

#[test]
fn bad_values_and_dtypes_are_reported() {
    let dir = edited(|t| {
        let table = t.get_mut("layers.0.ffn.gate.tid2eid").unwrap();
        table.data[0..4].copy_from_slice(&99i32.to_le_bytes());
    });
    let msg = load_err(dir.path());
    assert!(msg.contains("layers.0.ffn.gate.tid2eid") && msg.contains("expert id 99"), "{msg}");

    let dir = edited(|t| {
        let w = t.get_mut("layers.0.attn.wkv.weight").unwrap();
        w.dtype = Dtype::F8_E4M3;
        w.data = vec![0x38; w.shape.iter().product()];
    });
    let msg = load_err(dir.path());
    assert!(msg.contains("layers.0.attn.wkv.weight") && msg.contains("block-scale"), "{msg}");
}

#[test]
fn missing_config_field_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture().join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let mut conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    conf.as_object_mut().unwrap().remove("q_lora_rank");
    std::fs::write(dir.path().join("config.json"), conf.to_string()).unwrap();
    let msg = load_err(dir.path());
    assert!(msg.contains("`q_lora_rank` is missing"), "{msg}");
}

fn init(dir: &Path, preset: Preset, seed: u64, dtype: WeightDtype) {
    write_checkpoint(dir, &InitOptions::new(preset, seed, dtype)).unwrap();
}

#[test]
fn init_is_deterministic_per_seed() {
    let root = tempfile::tempdir().unwrap();
    let (a, b, c) = (root.path().join("a"), root.path().join("b"), root.path().join("c"));
    init(&a, Preset::Tiny, 7, WeightDtype::Bf16);
    init(&b, Preset::Tiny, 7, WeightDtype::Bf16);
    init(&c, Preset::Tiny, 8, WeightDtype::Bf16);
    let read = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(read(&a) == read(&b), "same seed, different bytes");
    assert!(read(&a) != read(&c), "different seeds, same bytes");
    assert!(
        write_checkpoint(&a, &InitOptions::new(Preset::Tiny, 1, WeightDtype::Bf16)).is_err(),
        "init must not overwrite"
    );
}

#[test]
fn init_checkpoints_load_and_generate_in_every_dtype() {
    let root = tempfile::tempdir().unwrap();
    let req = GenerateRequest {
        prompt: vec![3, 1, 4, 1, 5, 9, 2, 6],
        max_tokens: 6,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
    };
    let mut outputs = Vec::new();
    for dtype in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::Fp8] {
        let dir = root.path().join(format!("{dtype:?}"));
        init(&dir, Preset::Tiny, 3, dtype);
        let mut e = Engine::load(&dir, CpuBackend::new(), EngineOptions::default()).unwrap();
        let out = generate(&mut e, &req, |_| {}).unwrap();
        assert_eq!(out.tokens.len(), 6);
        assert!(out.tokens.iter().all(|t| t.logprob.is_finite() && t.logprob <= 0.0));
        outputs.push(out.tokens.iter().map(|t| t.token).collect::<Vec<_>>());
        assert_eq!(e.pool_stats().pages_used, 0, "generate releases its sequence");
    }
    // f32 and bf16 differ only by weight rounding; the first greedy token agrees.
    assert_eq!(outputs[0][0], outputs[1][0]);
}

#[test]
fn init_still_writes_the_checkpoint_the_reference_was_run_on() {
    // tests/golden/tiny-init holds `sluice model init --preset tiny --seed 11 --dtype bf16`
    // with reference logits; if init's output drifted, that fixture would test nothing.
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m");
    init(&dir, Preset::Tiny, 11, WeightDtype::Bf16);
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-init/model");
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        let (a, b) = (std::fs::read(dir.join(f)).unwrap(), std::fs::read(golden.join(f)).unwrap());
        assert!(
            a == b,
            "{f} differs from the committed fixture ({} vs {} bytes); regenerate tests/golden",
            a.len(),
            b.len()
        );
    }
}
