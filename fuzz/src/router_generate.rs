//! gRPC `sluice.v1.Generation/Generate` requests: protobuf bytes decoded by prost into
//! `GenerateRequest`, then the router's validation (`router/src/validate.rs`) against a
//! real model directory (the tiny test model: its config and tokenizer).
//!
//! Asserts: decoding and validation never panic; a refused request gets a non-empty
//! message; an accepted request satisfies every promise the workers rely on ([`check`]):
//! a non-empty prompt of in-vocabulary ids, `1 <= max_tokens <= limit`, prompt plus
//! `max_tokens` within the context, finite non-negative temperature, `top_p` in [0, 1],
//! at most `MAX_TOP_LOGPROBS` alternatives, in-vocabulary stop ids, non-empty stop
//! strings; a token-id prompt is passed through unchanged.

use std::path::Path;
use std::sync::OnceLock;

use prost::Message;
use router::inputs::{self, Limits, MAX_TOP_LOGPROBS, ModelInfo, Validated};
use sluice_proto::v1 as pb;

/// The server's `--max-tokens-limit` in these targets.
pub const MAX_TOKENS_LIMIT: u32 = 1024;

pub fn limits() -> Limits {
    Limits { max_tokens_limit: MAX_TOKENS_LIMIT }
}

/// The tiny test model (real config.json and tokenizer.json), loaded once.
pub fn model() -> &'static ModelInfo {
    static MODEL: OnceLock<ModelInfo> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/golden/tiny-init/model");
        ModelInfo::load(&dir, "tiny".into()).expect("the tiny test model loads")
    })
}

/// Every promise an accepted request makes to the rest of the router and the workers.
pub fn check(model: &ModelInfo, limits: &Limits, v: &Validated) {
    assert!(!v.prompt.is_empty(), "accepted prompts are not empty");
    assert!(v.prompt.iter().all(|&t| (t as usize) < model.vocab), "prompt ids are in the vocabulary");
    assert!(v.stop_ids.iter().all(|&t| (t as usize) < model.vocab), "stop ids are in the vocabulary");
    assert!((1..=limits.max_tokens_limit).contains(&v.max_tokens), "max_tokens within the limit");
    assert!(v.prompt.len() + v.max_tokens as usize <= model.max_position, "prompt + max_tokens fit the context");
    let s = &v.sampling;
    assert!(s.temperature.is_finite() && s.temperature >= 0.0, "temperature {}", s.temperature);
    assert!((0.0..=1.0).contains(&s.top_p), "top_p {}", s.top_p);
    assert!(s.top_logprobs <= MAX_TOP_LOGPROBS);
    assert!(v.stop_strings.iter().all(|s| !s.is_empty()), "stop strings are not empty");
}

pub fn run(data: &[u8]) {
    let Ok(r) = pb::GenerateRequest::decode(data) else { return };
    let ids = match &r.prompt {
        Some(pb::generate_request::Prompt::TokenIds(t)) => Some(t.ids.clone()),
        _ => None,
    };
    let (model, limits) = (model(), limits());
    match inputs::generate_request(model, &limits, r) {
        Ok(v) => {
            check(model, &limits, &v);
            if let Some(ids) = ids {
                assert_eq!(v.prompt, ids, "token ids pass through unchanged");
            }
        }
        Err(message) => assert!(!message.is_empty()),
    }
}
