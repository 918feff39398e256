//! In-process generation: prefill the prompt, then sample and decode one token at a
//! time until `max_tokens` or a stop token.

use std::time::{Duration, Instant};

use kernels::Backend;

use crate::engine::{Engine, Logits};
use crate::error::EngineError;
use crate::sampling::{Sampled, Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after emitting any of these.
    pub stop_tokens: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token was emitted.
    Stop,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<Sampled>,
    pub finish: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

/// Run a request to completion, calling `on_token` as each token is chosen.
pub fn generate<B: Backend>(
    engine: &mut Engine<B>,
    req: &GenerateRequest,
    mut on_token: impl FnMut(&Sampled),
) -> Result<Generation, EngineError> {
    req.sampling.validate().map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
    if req.max_tokens == 0 {
        return Err(EngineError::InvalidRequest("max_tokens must be at least 1".into()));
    }
    engine.validate(0, &req.prompt)?;
    // The last sampled token is never fed back, so the state holds prompt + max_tokens - 1.
    let limit = engine.config().max_position;
    if req.prompt.len() + req.max_tokens > limit {
        return Err(EngineError::ContextTooLong { tokens: req.prompt.len() + req.max_tokens, limit });
    }
    let mut seq = engine.open_sequence()?;
    let result = (|| {
        let mut sampler = Sampler::new(req.sampling.clone());
        let t0 = Instant::now();
        let mut logits = engine.prefill(&mut seq, &req.prompt, Logits::Last)?;
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut tokens = Vec::with_capacity(req.max_tokens);
        let finish = loop {
            let s = sampler.sample(&logits);
            on_token(&s);
            let tok = s.token;
            tokens.push(s);
            if req.stop_tokens.contains(&tok) {
                break FinishReason::Stop;
            }
            if tokens.len() == req.max_tokens {
                break FinishReason::Length;
            }
            logits = engine.decode(&mut [&mut seq], &[tok])?.remove(0);
        };
        Ok(Generation { tokens, finish, prefill_time, decode_time: t1.elapsed() })
    })();
    engine.release(seq);
    result
}
