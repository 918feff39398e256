//! Starting a chat request, shared by the HTTP and gRPC adapters: the plan's conversation
//! encoded for the served model, its grammar built, and one orchestrated request per
//! choice (`n`), each with its own seed.

use std::sync::Arc;

use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::chat::convert::ChatPlan;
use crate::chat::grammar::{GrammarTokens, grammar};
use crate::orchestrate::{self, Events, RouterCtx};
use crate::validate::{self, Limits, Prompt, Sampling};

/// Why a chat request did not start.
pub enum Refusal {
    /// Bad input (400 / INVALID_ARGUMENT); `param` names the field where it can.
    Invalid { message: String, param: Option<&'static str> },
    /// Anything else, already recorded (e.g. RESOURCE_EXHAUSTED).
    Status(Status),
}

/// A seed for choices that gave none: different per request, as OpenAI's sampling is.
fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    t.as_nanos() as u64 ^ 0x9e37_79b9_7f4a_7c15
}

/// Start the plan's choices; their events arrive on the returned receivers, in choice order.
pub fn start(
    ctx: &Arc<RouterCtx>,
    limits: &Limits,
    plan: &ChatPlan,
    request_id: &str,
    metadata: &MetadataMap,
) -> Result<Vec<Events>, Refusal> {
    let invalid = |message: String, param| Refusal::Invalid { message, param };
    let model = &ctx.model;
    let tokens = model.chat.as_ref().map_err(|why| invalid(why.clone(), Some("model")))?;
    let codec = model.codec.as_ref().ok_or_else(|| invalid("the model has no tokenizer".into(), Some("model")))?;
    let prompt = codec
        .encode(&plan.conversation.render())
        .map_err(|e| invalid(format!("cannot tokenize the conversation: {e}"), Some("messages")))?;
    let room = model.max_position.saturating_sub(prompt.len()) as u32;
    let max_tokens = plan.max_tokens.unwrap_or_else(|| limits.max_tokens_limit.min(room));
    let constraint = grammar(
        &plan.conversation,
        &plan.tool_policy,
        GrammarTokens { think_end: tokens.think_end, dsml: tokens.dsml },
    );
    let base_seed = plan.seed.unwrap_or_else(fresh_seed);
    let mut streams: Vec<Events> = Vec::with_capacity(plan.n as usize);
    for i in 0..plan.n {
        let id = if plan.n == 1 { request_id.to_string() } else { format!("{request_id}-{i}") };
        let arrival = orchestrate::arrive(&id, metadata);
        let sampling = Sampling {
            temperature: plan.temperature,
            top_p: plan.top_p,
            top_k: plan.top_k,
            seed: Some(base_seed.wrapping_add(i as u64)),
            logprobs: plan.logprobs,
            top_logprobs: plan.top_logprobs,
        };
        let checked = validate::validate(
            model,
            limits,
            id,
            &plan.model,
            Some(Prompt::Ids(prompt.clone())),
            max_tokens,
            sampling,
            vec![tokens.eos],
            plan.stop.clone(),
        );
        let mut v =
            checked.map_err(|m| Refusal::Status(orchestrate::refuse(ctx, &arrival, Status::invalid_argument(m))))?;
        v.constraint = constraint.clone();
        // On failure, dropping the choices already started cancels them.
        streams.push(orchestrate::start(ctx.clone(), v, arrival).map_err(Refusal::Status)?);
    }
    Ok(streams)
}
