//! Checkpoint directories as the engine opens them (`engine/src/checkpoint/`): the
//! safetensors header of each file, the shard index `model.safetensors.index.json`, and
//! every tensor decoded as the loader decodes it (weight matrices with their block
//! scales, float and integer tables, HF's fused expert tensors).
//!
//! Asserts: opening and decoding never panic; every tensor the header admits has
//! exactly the bytes its dtype and shape need, inside the file; a weight matrix the
//! decoder accepts validates and dequantises to `rows × cols` values; accepted float
//! and integer tables have one value per element; fused experts slice into views that
//! validate. The first byte picks raw file bytes, a checkpoint built with the real
//! writer from fuzzer-chosen names, dtypes, shapes and bytes, or a shard index (raw
//! JSON) over such a file.

use std::path::Path;
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use engine::checkpoint::{Checkpoint, OwnedTensor, write_safetensors};
use safetensors::Dtype;

/// Names the loader looks for (official and HF), block scales beside them, fused experts.
const NAMES: [&str; 14] = [
    "embed.weight",
    "model.embed_tokens.weight",
    "layers.0.attn.wq_a.weight",
    "layers.0.attn.wq_a.scale",
    "layers.0.ffn.experts.0.w1.weight",
    "layers.0.ffn.experts.0.w1.scale",
    "layers.0.ffn.gate.tid2eid",
    "hc_head_fn",
    "model.layers.0.self_attn.q_a_proj.weight",
    "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.experts.down_proj",
    "model.layers.0.mlp.gate.tid2eid",
    "mtp.0.emb.weight",
];

const DTYPES: [Dtype; 12] = [
    Dtype::F32,
    Dtype::BF16,
    Dtype::F16,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::U8,
    Dtype::I8,
    Dtype::F4,
    Dtype::I64,
    Dtype::I32,
    Dtype::U16,
    Dtype::BOOL,
];

#[derive(Arbitrary, Debug)]
struct TensorSpec {
    name: u8,
    dtype: u8,
    shape: Vec<u8>,
    fill: u8,
}

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    match mode % 3 {
        0 => std::fs::write(dir.path().join("model.safetensors"), rest).expect("write"),
        1 => {
            if !build(&dir.path().join("model.safetensors"), rest) {
                return;
            }
        }
        _ => {
            let Ok(index) = serde_json::from_slice::<serde_json::Value>(rest) else { return };
            // Shard names are the operator's files: keep the fuzzer inside the directory.
            let mut shards: Vec<&str> = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| m.values().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            if shards.iter().any(|s| s.is_empty() || s.contains('/') || s.starts_with('.')) {
                return;
            }
            shards.sort_unstable();
            shards.dedup();
            std::fs::write(dir.path().join("model.safetensors.index.json"), rest).expect("write");
            for shard in shards.iter().take(4) {
                std::fs::write(dir.path().join(shard), official()).expect("write");
            }
        }
    }
    check(dir.path());
}

fn official() -> &'static [u8] {
    static FILE: OnceLock<Vec<u8>> = OnceLock::new();
    FILE.get_or_init(crate::seeds::official_checkpoint)
}

/// A file written by the real writer; `false` when the bytes describe none.
fn build(path: &Path, bytes: &[u8]) -> bool {
    let mut u = Unstructured::new(bytes);
    let Ok(specs) = Vec::<TensorSpec>::arbitrary(&mut u) else { return false };
    let mut tensors: Vec<(String, OwnedTensor)> = Vec::new();
    for s in specs.iter().take(8) {
        let name = NAMES[s.name as usize % NAMES.len()].to_string();
        if tensors.iter().any(|(n, _)| *n == name) {
            continue;
        }
        let dtype = DTYPES[s.dtype as usize % DTYPES.len()];
        let shape: Vec<usize> = s.shape.iter().take(3).map(|&d| d as usize % 40).collect();
        let bits = shape.iter().product::<usize>() * dtype.bitsize();
        if !bits.is_multiple_of(8) || bits / 8 > 1 << 16 {
            continue;
        }
        let data = (0..bits / 8).map(|i| (i as u8).wrapping_mul(s.fill | 1).wrapping_add(s.fill)).collect();
        tensors.push((name, OwnedTensor { dtype, shape, data }));
    }
    write_safetensors(path, &tensors).is_ok()
}

fn check(dir: &Path) {
    let Ok(ck) = Checkpoint::open(dir) else { return };
    let tensors: Vec<_> = ck.files().tensors().collect();
    for t in &tensors {
        let elems: usize = t.shape.iter().product();
        assert_eq!(t.bytes.len() * 8, elems * t.dtype.bitsize(), "tensor `{}` has the bytes its shape needs", t.name);
        if let &[rows, cols] = t.shape {
            for cols in [cols, 2 * cols] {
                if let Ok(view) = ck.weight(t.name, rows, cols) {
                    view.validate().expect("an accepted weight validates");
                    assert_eq!(view.dequantize().len(), rows * cols);
                }
            }
        }
        if let Ok(v) = ck.floats(t.name, t.shape) {
            assert_eq!(v.len(), elems);
        }
        if let Ok(v) = ck.ints(t.name, t.shape) {
            assert_eq!(v.len(), elems);
        }
    }
    let fused = ck.files().get("model.layers.0.mlp.experts.gate_up_proj");
    if let Some([n, two_inter, hidden]) = fused.map(|t| t.shape) {
        let (n, inter, hidden) = (*n, *two_inter / 2, *hidden);
        if n > 0
            && inter > 0
            && hidden > 0
            && let Ok(experts) = ck.experts(0, n, inter, hidden)
        {
            assert_eq!(experts.len(), n);
            for e in experts.iter().flatten() {
                e.validate().expect("a fused expert slice validates");
            }
        }
    }
}
