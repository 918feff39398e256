//! Chat requests: `POST /v1/chat/completions` JSON bodies (serde) and gRPC
//! `sluice.v1.Generation/Chat` protobuf (prost, then converted to the same request
//! type), planned (`router/src/chat/convert.rs`), encoded into the V4 prompt
//! (`encoding.rs`), given their grammar (`grammar.rs`), and the encoded prompt validated
//! as `chat_run` validates it. The first byte picks JSON or protobuf.
//!
//! Asserts: never a panic; refusals carry a message; an accepted plan has `1 <= n <=
//! MAX_CHOICES`, temperature in [0, 2], a positive `top_p`, `top_logprobs` only with
//! `logprobs`, valid tool names, a forced tool policy only with tools (a named one naming
//! one of them); its prompt renders, and a constrained plan (forced tools or a JSON
//! response format) gets a grammar while a free one gets none; the tokenised prompt
//! validates into a request that keeps [`crate::router_generate::check`]'s promises.

use prost::Message;
use router::chat::convert::{MAX_CHOICES, ToolPolicy};
use router::chat::encoding::ResponseFormat;
use router::chat::grammar::{GrammarTokens, grammar};
use router::inputs::{self, ChatPlan, Prompt, Sampling};
use sluice_proto::v1 as pb;

use crate::router_generate::{check, limits, model};

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let plan = if mode & 1 == 0 {
        inputs::chat_body(rest)
    } else {
        let Ok(r) = pb::ChatRequest::decode(rest) else { return };
        inputs::chat_request(r)
    };
    match plan {
        Ok(plan) => planned(&plan),
        Err(message) => assert!(!message.is_empty()),
    }
}

fn planned(plan: &ChatPlan) {
    assert!((1..=MAX_CHOICES).contains(&plan.n), "n {}", plan.n);
    assert!((0.0..=2.0).contains(&plan.temperature), "temperature {}", plan.temperature);
    assert!(plan.top_p > 0.0, "top_p {}", plan.top_p);
    assert!(plan.top_logprobs == 0 || plan.logprobs, "top_logprobs needs logprobs");
    let tools = &plan.conversation.tools;
    for t in tools {
        let ok = (1..=64).contains(&t.name.len())
            && t.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        assert!(ok, "tool name `{}`", t.name);
    }
    match &plan.tool_policy {
        ToolPolicy::Auto => {}
        ToolPolicy::Required => assert!(!tools.is_empty()),
        ToolPolicy::Named(n) => assert!(tools.iter().any(|t| &t.name == n)),
    }
    let text = plan.conversation.render();
    assert!(!text.is_empty(), "a conversation renders to a prompt");
    let constrained = plan.tool_policy != ToolPolicy::Auto || plan.conversation.response_format != ResponseFormat::Text;
    let g = grammar(&plan.conversation, &plan.tool_policy, GrammarTokens { think_end: 2, dsml: 3 });
    assert_eq!(g.is_some(), constrained, "constrained plans, and only they, get a grammar");

    // What chat_run does next for each choice: tokenise the prompt and validate it.
    let (model, limits) = (model(), limits());
    let Some(codec) = model.codec.as_ref() else { return };
    let Ok(prompt) = codec.encode(&text) else { return };
    let room = model.max_position.saturating_sub(prompt.len()) as u32;
    let max_tokens = plan.max_tokens.unwrap_or_else(|| limits.max_tokens_limit.min(room));
    let sampling = Sampling {
        temperature: plan.temperature,
        top_p: plan.top_p,
        top_k: plan.top_k,
        seed: plan.seed,
        logprobs: plan.logprobs,
        top_logprobs: plan.top_logprobs,
    };
    let checked = inputs::validate(
        model,
        &limits,
        "chat".into(),
        &plan.model,
        Some(Prompt::Ids(prompt)),
        max_tokens,
        sampling,
        vec![1],
        plan.stop.clone(),
    );
    match checked {
        Ok(v) => check(model, &limits, &v),
        Err(message) => assert!(!message.is_empty()),
    }
}
