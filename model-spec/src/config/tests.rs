use crate::layout::AttnKind;
use serde_json::{Value, json};

use super::*;

const HF_FLASH: &str = include_str!("../../tests/fixtures/deepseek-v4-flash/config.json");
const REF_FLASH: &str = include_str!("../../tests/fixtures/deepseek-v4-flash/inference-config.json");

#[test]
fn both_real_flash_configs_describe_the_same_model() {
    let hf = ModelConfig::from_json_str(HF_FLASH).unwrap();
    let reference = ModelConfig::from_json_str(REF_FLASH).unwrap();
    assert_eq!(hf, reference);

    assert_eq!(hf.num_layers, 43);
    assert_eq!(hf.mtp_layers, 1);
    assert_eq!((hf.count(AttnKind::Window), hf.count(AttnKind::Csa), hf.count(AttnKind::Hca)), (2, 21, 20));
    assert_eq!(&hf.compress_ratios[..4], &[0, 0, 4, 128]);
    assert_eq!(hf.mlp_kinds.iter().filter(|k| **k == MlpKind::HashMoe).count(), 3);
    assert_eq!((hf.head_dim, hf.rope_head_dim, hf.index_topk, hf.window), (512, 64, 512, 128));
    assert_eq!(hf.yarn.unwrap().factor, 16.0);
    assert_eq!(hf.max_position, 1 << 20);
    assert_eq!((hf.dense_dtype, hf.expert_dtype), (StoredDtype::Fp8, StoredDtype::Fp4));
}

fn hf_with(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Result<ModelConfig, ConfigError> {
    let mut v: Value = serde_json::from_str(HF_FLASH).unwrap();
    edit(v.as_object_mut().unwrap());
    parse_hf(&v)
}

fn field_of(e: ConfigError) -> String {
    match e {
        ConfigError::Missing { field } | ConfigError::Invalid { field, .. } => field,
        ConfigError::Read { .. } => panic!("unexpected read error {e}"),
    }
}

#[test]
fn invalid_configs_name_the_field() {
    type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, Value>)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("hidden_size", Box::new(|m| drop(m.remove("hidden_size")))),
        ("o_groups", Box::new(|m| drop(m.insert("o_groups".into(), json!(7))))),
        ("compress_ratios[5]", Box::new(|m| m["compress_ratios"][5] = json!(16))),
        ("compress_ratios", Box::new(|m| drop(m.insert("compress_ratios".into(), json!([0, 4]))))),
        ("scoring_func", Box::new(|m| drop(m.insert("scoring_func".into(), json!("softmax"))))),
        ("num_experts_per_tok", Box::new(|m| drop(m.insert("num_experts_per_tok".into(), json!(300))))),
        ("qk_rope_head_dim", Box::new(|m| drop(m.insert("qk_rope_head_dim".into(), json!(63))))),
        ("vocab_size", Box::new(|m| drop(m.insert("vocab_size".into(), json!("big"))))),
        ("rope_scaling.factor", Box::new(|m| drop(m["rope_scaling"].as_object_mut().unwrap().remove("factor")))),
        ("num_key_value_heads", Box::new(|m| drop(m.insert("num_key_value_heads".into(), json!(8))))),
        ("sliding_window", Box::new(|m| drop(m.insert("sliding_window".into(), json!(4096))))),
        // fuzz/regressions/model_config/odd-head-dim: an FP8 KV layout of it panicked.
        ("head_dim", Box::new(|m| drop(m.insert("head_dim".into(), json!(511))))),
    ];
    for (field, edit) in cases {
        let err = hf_with(edit).expect_err(field);
        assert_eq!(field_of(err.clone()), field, "{err}");
        assert!(err.to_string().contains(field), "message `{err}` does not name {field}");
    }
}

#[test]
fn transformers_style_keys_parse_like_legacy_ones() {
    let legacy = hf_with(|_| {}).unwrap();
    let modern = hf_with(|m| {
        let ratios: Vec<u64> = m["compress_ratios"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let types: Vec<&str> = ratios[..43]
            .iter()
            .map(|r| match r {
                0 => "sliding_attention",
                4 => "compressed_sparse_attention",
                _ => "heavily_compressed_attention",
            })
            .collect();
        m.remove("compress_ratios");
        m.remove("num_hash_layers");
        m.remove("qk_rope_head_dim");
        let scaling = m.remove("rope_scaling").unwrap();
        m.insert("layer_types".into(), json!(types));
        m.insert(
            "mlp_layer_types".into(),
            json!((0..43).map(|l| if l < 3 { "hash_moe" } else { "moe" }).collect::<Vec<_>>()),
        );
        m.insert("partial_rotary_factor".into(), json!(0.125));
        let mut compress = scaling.as_object().unwrap().clone();
        compress.insert("rope_theta".into(), json!(160000));
        compress.insert("rope_type".into(), json!("yarn"));
        m.insert(
            "rope_parameters".into(),
            json!({"main": {"rope_type": "default", "rope_theta": 10000}, "compress": compress}),
        );
    })
    .unwrap();
    assert_eq!(modern, legacy);
}

#[test]
fn reference_form_requires_its_own_names() {
    let mut v: Value = serde_json::from_str(REF_FLASH).unwrap();
    v.as_object_mut().unwrap().remove("n_activated_experts");
    assert_eq!(field_of(parse_reference(&v).unwrap_err()), "n_activated_experts");
}
