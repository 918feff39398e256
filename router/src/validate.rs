//! Turning a client request into a checked one. Every rejection is INVALID_ARGUMENT
//! with a message that says what to change.

use sluice_proto::v1 as pb;

use crate::model::ModelInfo;

/// Most alternatives per token a client may ask for.
pub const MAX_TOP_LOGPROBS: u32 = 20;

#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
    pub logprobs: bool,
    pub top_logprobs: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Validated {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    /// A grammar (llguidance Lark) every sampled token must satisfy; chat requests only.
    pub constraint: Option<String>,
}

/// A prompt as the client sent it.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

pub struct Limits {
    pub max_tokens_limit: u32,
}

/// Check everything about a request that can be checked without a worker.
#[allow(clippy::too_many_arguments)]
pub fn validate(
    model: &ModelInfo,
    limits: &Limits,
    request_id: String,
    model_name: &str,
    prompt: Option<Prompt>,
    max_tokens: u32,
    sampling: Sampling,
    stop_ids: Vec<u32>,
    stop_strings: Vec<String>,
) -> Result<Validated, String> {
    if !model_name.is_empty() && model_name != model.name {
        return Err(format!("unknown model `{model_name}`; this router serves `{}`", model.name));
    }
    let prompt = match prompt {
        None => return Err("the request has no prompt; set text or token_ids".into()),
        Some(Prompt::Text(t)) => {
            let codec = model.codec.as_ref().ok_or_else(|| {
                format!("model `{}` has no tokenizer.json, so it takes token ids only; send token_ids", model.name)
            })?;
            codec.encode(&t).map_err(|e| format!("cannot tokenize the prompt: {e}"))?
        }
        Some(Prompt::Ids(ids)) => ids,
    };
    if prompt.is_empty() {
        return Err("the prompt is empty; send at least one token".into());
    }
    if let Some((i, &t)) = prompt.iter().enumerate().find(|(_, t)| **t as usize >= model.vocab) {
        return Err(format!("token id {t} (prompt position {i}) is outside the vocabulary (size {})", model.vocab));
    }
    if let Some(&t) = stop_ids.iter().find(|t| **t as usize >= model.vocab) {
        return Err(format!("stop token id {t} is outside the vocabulary (size {})", model.vocab));
    }
    if max_tokens == 0 {
        return Err("max_tokens must be at least 1".into());
    }
    if max_tokens > limits.max_tokens_limit {
        return Err(format!("max_tokens {max_tokens} is above this server's limit of {}", limits.max_tokens_limit));
    }
    let total = prompt.len() + max_tokens as usize;
    if total > model.max_position {
        return Err(format!(
            "the prompt ({} tokens) plus max_tokens ({max_tokens}) is {total} tokens, past the context limit of {}; shorten the prompt or lower max_tokens",
            prompt.len(),
            model.max_position
        ));
    }
    if !sampling.temperature.is_finite() || sampling.temperature < 0.0 {
        return Err(format!("temperature must be a number >= 0, got {}", sampling.temperature));
    }
    if !(0.0..=1.0).contains(&sampling.top_p) {
        return Err(format!("top_p must be in (0, 1], got {}", sampling.top_p));
    }
    if sampling.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}", sampling.top_logprobs));
    }
    if stop_strings.iter().any(String::is_empty) {
        return Err("stop strings must not be empty".into());
    }
    if !stop_strings.is_empty() && model.codec.is_none() {
        return Err(format!(
            "model `{}` has no tokenizer.json, so stop strings cannot be matched; use stop token ids",
            model.name
        ));
    }
    Ok(Validated { request_id, prompt, max_tokens, sampling, stop_ids, stop_strings, constraint: None })
}

/// Validate a gRPC `GenerateRequest`.
pub fn from_proto(
    model: &ModelInfo,
    limits: &Limits,
    r: pb::GenerateRequest,
    request_id: String,
) -> Result<Validated, String> {
    let s = r.sampling.unwrap_or_default();
    let stop = r.stop.unwrap_or_default();
    let prompt = r.prompt.map(|p| match p {
        pb::generate_request::Prompt::Text(t) => Prompt::Text(t),
        pb::generate_request::Prompt::TokenIds(ids) => Prompt::Ids(ids.ids),
    });
    let sampling = Sampling {
        temperature: s.temperature,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        top_k: s.top_k,
        seed: s.seed,
        logprobs: s.logprobs || s.top_logprobs > 0,
        top_logprobs: s.top_logprobs,
    };
    validate(model, limits, request_id, &r.model, prompt, r.max_tokens, sampling, stop.token_ids, stop.strings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelInfo {
        ModelInfo {
            name: "small".into(),
            vocab: 100,
            max_position: 64,
            codec: None,
            layers: 8,
            window: 128,
            chat: Err("no chat".into()),
        }
    }

    fn greedy() -> Sampling {
        Sampling { temperature: 0.0, top_p: 1.0, top_k: 0, seed: None, logprobs: false, top_logprobs: 0 }
    }

    fn check(prompt: Option<Prompt>, max_tokens: u32, model_name: &str) -> Result<Validated, String> {
        validate(
            &model(),
            &Limits { max_tokens_limit: 32 },
            "r".into(),
            model_name,
            prompt,
            max_tokens,
            greedy(),
            vec![],
            vec![],
        )
    }

    #[test]
    fn rejections_say_what_to_change() {
        let ids = |v: &[u32]| Some(Prompt::Ids(v.to_vec()));
        assert!(check(ids(&[1, 2]), 4, "").is_ok());
        assert!(check(ids(&[1, 2]), 4, "small").is_ok());
        let cases: Vec<(Result<Validated, String>, &str)> = vec![
            (check(ids(&[1, 100]), 4, ""), "token id 100 (prompt position 1) is outside the vocabulary (size 100)"),
            (check(ids(&[]), 4, ""), "the prompt is empty"),
            (check(None, 4, ""), "no prompt"),
            (check(ids(&[1]), 0, ""), "max_tokens must be at least 1"),
            (check(ids(&[1]), 33, ""), "above this server's limit of 32"),
            (check(ids(&[1; 40]), 30, ""), "past the context limit of 64"),
            (check(ids(&[1]), 4, "large"), "unknown model `large`"),
            (check(Some(Prompt::Text("hi".into())), 4, ""), "send token_ids"),
        ];
        for (got, want) in cases {
            let err = got.expect_err(want);
            assert!(err.contains(want), "`{err}` lacks `{want}`");
        }
    }
}
