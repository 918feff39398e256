//! The seed corpus: small valid inputs made by the real encoders (and the repository's
//! own config files), one list per target. `tests/fuzz.rs` checks that
//! `corpus/<target>/` holds them (`SLUICE_FUZZ_WRITE_SEEDS=1` writes them).

use std::path::Path;

use engine::checkpoint::{OwnedTensor, write_safetensors};
use engine::{EntryDtype, Fingerprint};
use kvstore::record::{Header, Kind, Pools, checksum, tombstone_payload};
use kvstore::segment::Segment;
use prost::Message;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use sluice_proto::v1 as pb;
use transfer::{RegionSpec, Target, WireGeometry};

use crate::sequence_export;
use crate::structured::key;

/// `(file name, bytes)` of every seed of `target`.
pub fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = match target {
        "kv_wire" => kv_wire(),
        "kvstore_record" => kvstore_record(),
        "kvstore_segment" => kvstore_segment(),
        "kvstore_recovery" => random("recovery", 4, 600),
        "sequence_export" => sequence_export(),
        "router_generate" => router_generate(),
        "router_completion" => router_completion(),
        "router_chat" => router_chat(),
        "safetensors" => safetensors(),
        "model_config" => model_config(),
        other => panic!("no seeds for unknown target `{other}`"),
    };
    out.iter_mut().for_each(|(name, _)| name.insert_str(0, "seed-"));
    out
}

fn tagged(tag: u8, bytes: Vec<u8>) -> Vec<u8> {
    let mut v = vec![tag];
    v.extend(bytes);
    v
}

/// Deterministic bytes: structure-driven targets read them through `arbitrary`.
fn random(prefix: &str, count: u64, len: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let mut rng = ChaCha8Rng::seed_from_u64(i);
            (format!("{prefix}-{i}"), (0..len).map(|_| rng.random()).collect())
        })
        .collect()
}

fn kv_wire() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for dtype in [EntryDtype::Bf16, EntryDtype::Fp8] {
        let g = WireGeometry::new(&sequence_export::layout(dtype), &Fingerprint([7; 32]), 64);
        let region = |n: usize| RegionSpec { base: 1 << 20, len: n as u64, rkey: vec![1, 2, 3, 4] };
        let t = Target {
            pages: region(4 * g.page_bytes),
            rings: region(2 * g.ring_bytes),
            comp: region(2 * g.comp_bytes),
            logits: region(2 * g.logits_bytes),
            geometry: g,
            ucx_address: vec![9; 16],
            page_ids: vec![2, 0, 3],
            slot: 1,
        };
        out.push((format!("target-{}", dtype.name()), tagged(0, t.to_proto().encode_to_vec())));
    }
    let commit = pb::CommitRequest {
        reservation_id: "r-1".into(),
        tokens: 200,
        page_checksums: vec![1, 2],
        rings_checksum: 3,
        comp_checksum: 4,
        logits_checksum: 5,
    };
    out.push(("commit".into(), tagged(1, commit.encode_to_vec())));
    out
}

fn header(kind: Kind, k: u8, parent: Option<u8>, payload: &[u8]) -> Header {
    Header {
        kind,
        depth: parent.map_or(0, |_| 1),
        key: key(k),
        parent: parent.map(key),
        pools: Pools { csa_main: payload.len() as u64 / 2, csa_indexer: 8, hca: 4, swa: 0 },
        payload_len: payload.len() as u64,
        payload_checksum: checksum(payload),
    }
}

fn kvstore_record() -> Vec<(String, Vec<u8>)> {
    let page = header(Kind::Page, 1, Some(0), b"page bytes").encode().to_vec();
    let tomb = tombstone_payload(1, 146);
    let mut tombstone = header(Kind::Tombstone, 1, None, &tomb).encode().to_vec();
    tombstone.extend(&tomb);
    vec![("page".into(), tagged(0, page)), ("tombstone".into(), tagged(1, tombstone))]
}

/// A segment written by `Segment::append`: a root page, a child page, a snapshot and a
/// tombstone of the child.
pub fn segment_bytes() -> Vec<u8> {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut seg = Segment::create(dir.path(), 1).expect("segment");
    let (a, b, snap) = (vec![1u8; 40], vec![2u8; 24], vec![3u8; 16]);
    seg.append(&header(Kind::Page, 0, None, &a), &a).expect("append");
    let child = seg.append(&header(Kind::Page, 1, Some(0), &b), &b).expect("append");
    seg.append(&header(Kind::Snapshot, 0, None, &snap), &snap).expect("append");
    let tomb = tombstone_payload(1, child);
    let mut h = header(Kind::Tombstone, 1, None, &tomb);
    h.depth = Kind::Page.code() as u32;
    seg.append(&h, &tomb).expect("append");
    std::fs::read(kvstore::segment::path(dir.path(), 1)).expect("read back")
}

fn kvstore_segment() -> Vec<(String, Vec<u8>)> {
    let mut out = vec![("appended".to_string(), tagged(0, segment_bytes()))];
    out.extend(random("built", 2, 300).into_iter().map(|(n, b)| (n, tagged(1, b))));
    out
}

fn sequence_export() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, dtype) in [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8].into_iter().enumerate() {
        let tag = (i as u8) << 1;
        for tokens in [1, 130] {
            let bytes = sequence_export::export(dtype, tokens, tokens as u8);
            out.push((format!("{}-{tokens}", dtype.name()), tagged(tag, bytes)));
        }
        let mut patched = vec![tag | 1, 130];
        patched.extend(130u64.to_le_bytes());
        patched.extend(2u32.to_le_bytes());
        patched.push(0);
        out.push((format!("{}-patched", dtype.name()), patched));
    }
    out
}

fn router_generate() -> Vec<(String, Vec<u8>)> {
    let ids = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: vec![5, 6, 7] })),
        max_tokens: 8,
        sampling: Some(pb::SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 20,
            seed: Some(3),
            logprobs: true,
            top_logprobs: 2,
        }),
        stop: Some(pb::StopCriteria { token_ids: vec![1], strings: vec!["\n\n".into()] }),
        ..Default::default()
    };
    let text = pb::GenerateRequest {
        model: "tiny".into(),
        prompt: Some(pb::generate_request::Prompt::Text("The quick brown fox".into())),
        max_tokens: 16,
        request_id: "r-1".into(),
        ..Default::default()
    };
    vec![("ids".into(), ids.encode_to_vec()), ("text".into(), text.encode_to_vec())]
}

fn router_completion() -> Vec<(String, Vec<u8>)> {
    [
        ("text", r#"{"model":"tiny","prompt":"The quick brown fox","max_tokens":8,"temperature":0.5,"stop":"."}"#),
        ("ids", r#"{"prompt":[5,6,7],"max_tokens":4,"top_p":0.9,"top_k":5,"seed":1,"logprobs":2,"n":1,"stream":true,"stream_options":{"include_usage":true},"stop":["a","b"]}"#),
        ("lists", r#"{"prompt":[[1,2,3]],"max_tokens":2,"user":"u"}"#),
    ]
    .into_iter()
    .map(|(n, b)| (n.to_string(), b.as_bytes().to_vec()))
    .collect()
}

fn router_chat() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = [
        ("plain", r#"{"model":"tiny","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_tokens":8}"#),
        ("tools", r#"{"messages":[{"role":"user","content":"Weather in Paris?"},{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}],"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],"tool_choice":"required","thinking":{"type":"enabled"},"reasoning_effort":"high"}"#),
        ("schema", r#"{"messages":[{"role":"user","content":[{"type":"text","text":"Answer in JSON"}]}],"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object","properties":{"x":{"type":"integer"}}}}},"n":2,"logprobs":true,"top_logprobs":3,"temperature":0.2,"top_p":0.5,"top_k":4,"stop":["\n"],"chat_template_kwargs":{"enable_thinking":true}}"#),
        ("named", r#"{"messages":[{"role":"developer","content":"json"},{"role":"latest_reminder","content":"x"},{"role":"user","content":"go"}],"tools":[{"type":"function","function":{"name":"f","strict":true}}],"tool_choice":{"type":"function","function":{"name":"f"}},"response_format":{"type":"json_object"},"stream":true,"stream_options":{"include_usage":true}}"#),
    ]
    .into_iter()
    .map(|(n, b)| (format!("json-{n}"), tagged(0, b.as_bytes().to_vec())))
    .collect();
    let proto = pb::ChatRequest {
        model: "tiny".into(),
        messages: vec![
            pb::ChatMessage { role: "system".into(), content: "Be brief.".into(), ..Default::default() },
            pb::ChatMessage { role: "user".into(), content: "Call f".into(), ..Default::default() },
            pb::ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![pb::ToolCall { id: "c1".into(), name: "f".into(), arguments: "{\"a\": 1}".into() }],
                ..Default::default()
            },
            pb::ChatMessage {
                role: "tool".into(),
                content: "ok".into(),
                tool_call_id: "c1".into(),
                ..Default::default()
            },
        ],
        tools: vec![pb::ToolDefinition {
            name: "f".into(),
            description: "a function".into(),
            parameters_json: r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#.into(),
            strict: true,
        }],
        tool_choice: "f".into(),
        thinking: true,
        max_tokens: 32,
        n: 1,
        response_format: Some(pb::ResponseFormat { r#type: "text".into(), json_schema: String::new() }),
        ..Default::default()
    };
    out.push(("proto".into(), tagged(1, proto.encode_to_vec())));
    out
}

fn tensor(dtype: Dtype, shape: Vec<usize>) -> OwnedTensor {
    let n: usize = shape.iter().product::<usize>() * dtype.bitsize() / 8;
    OwnedTensor { dtype, shape, data: (0..n).map(|i| (i * 37 % 251) as u8).collect() }
}

fn checkpoint_file(tensors: &[(String, OwnedTensor)]) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, tensors).expect("write");
    std::fs::read(path).expect("read back")
}

/// A small checkpoint in official names: BF16, FP8 + block scale, packed FP4 + scales,
/// an integer table and an F32 tensor.
pub fn official_checkpoint() -> Vec<u8> {
    let t = tensor;
    checkpoint_file(&[
        ("embed.weight".to_string(), t(Dtype::BF16, vec![8, 4])),
        ("layers.0.attn.wq_a.weight".to_string(), t(Dtype::F8_E4M3, vec![4, 8])),
        ("layers.0.attn.wq_a.scale".to_string(), t(Dtype::F8_E8M0, vec![1, 1])),
        ("layers.0.ffn.experts.0.w1.weight".to_string(), t(Dtype::I8, vec![2, 32])),
        ("layers.0.ffn.experts.0.w1.scale".to_string(), t(Dtype::F8_E8M0, vec![2, 2])),
        ("layers.0.ffn.gate.tid2eid".to_string(), t(Dtype::I32, vec![8, 2])),
        ("hc_head_fn".to_string(), t(Dtype::F32, vec![4, 2])),
    ])
}

fn safetensors() -> Vec<(String, Vec<u8>)> {
    let t = tensor;
    let hf = vec![
        ("model.embed_tokens.weight".to_string(), t(Dtype::F16, vec![8, 4])),
        ("model.layers.0.mlp.experts.gate_up_proj".to_string(), t(Dtype::BF16, vec![2, 4, 4])),
        ("model.layers.0.mlp.experts.down_proj".to_string(), t(Dtype::BF16, vec![2, 4, 2])),
    ];
    let index = br#"{"metadata":{"total_size":6},"weight_map":{"embed.weight":"a.safetensors"}}"#.to_vec();
    let mut out = vec![
        ("official".to_string(), tagged(0, official_checkpoint())),
        ("hf-fused".to_string(), tagged(0, checkpoint_file(&hf))),
        ("index".to_string(), tagged(2, index)),
    ];
    out.extend(random("built", 2, 200).into_iter().map(|(n, b)| (n, tagged(1, b))));
    out
}

fn model_config() -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    [
        ("flash-hf", "model-spec/tests/fixtures/deepseek-v4-flash/config.json"),
        ("flash-reference", "model-spec/tests/fixtures/deepseek-v4-flash/inference-config.json"),
        ("pro", "engine/src/init/configs/deepseek-v4-pro.json"),
        ("tiny-init", "engine/tests/golden/tiny-init/model/config.json"),
        ("tiny-hf", "engine/tests/golden/tiny-hf/model/config.json"),
        ("tiny-hf-saved", "engine/tests/golden/tiny-hf/model-saved/config.json"),
        ("tiny-quant", "engine/tests/golden/tiny-quant/model/config.json"),
        ("tiny-official", "engine/tests/golden/tiny-official/model/config.json"),
    ]
    .into_iter()
    .map(|(n, p)| (n.to_string(), std::fs::read(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"))))
    .collect()
}
