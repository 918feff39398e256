//! `POST /v1/chat/completions`: a thin adapter from the OpenAI request to the chat core
//! (`chat`) and the request orchestration. `n` choices run as `n` requests over the same
//! prompt (the prefix cache makes the repeats cheap); their events are merged as they come.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_proto::v1 as pb;
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

use crate::chat::ChatError;
use crate::chat::convert::{self, ChatPlan};
use crate::chat::output::{Delta, OutputParser};
use crate::chat::request::ChatRequest;
use crate::chat_run::{self, Refusal};
use crate::http::{Body, HttpState, error, now_s, status_response, usage_json};
use crate::orchestrate::{Event, TokenOut};

/// One choice as it builds up.
struct Choice {
    parser: OutputParser,
    reasoning: String,
    content: String,
    /// (id, name, arguments)
    calls: Vec<(String, String, String)>,
    finish: Option<&'static str>,
    usage: (u32, u32, u32),
}

/// What one request's shared fields are.
struct Reply {
    id: String,
    created: u64,
    model: String,
    fingerprint: Option<String>,
}

impl Reply {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint, "choices": choices})
    }
}

fn invalid(state: &HttpState, message: impl Into<String>, param: Option<&str>) -> Response {
    state.ctx.metrics.outcome(Code::InvalidArgument);
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message, param, None)
}

pub async fn chat_completions(
    State(state): State<Arc<HttpState>>,
    headers: HeaderMap,
    Body(r): Body<ChatRequest>,
) -> Response {
    let request_id =
        headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string).unwrap_or_else(|| "unset".into());
    let metadata = MetadataMap::from_headers(headers);
    let plan = match convert::plan(r) {
        Ok(p) => p,
        Err(ChatError::Invalid { message, param }) => return invalid(&state, message, param),
    };
    let streams = match chat_run::start(&state.ctx, &state.limits, &plan, &request_id, &metadata) {
        Ok(s) => s,
        Err(Refusal::Invalid { message, param }) => return invalid(&state, message, param),
        Err(Refusal::Status(s)) => return status_response(&s),
    };
    let model = &state.ctx.model;
    let reply = Reply {
        id: format!("chatcmpl-{request_id}"),
        created: now_s(),
        model: model.name.clone(),
        fingerprint: state.ctx.workers.fingerprint(),
    };
    let choices: Vec<Choice> = (0..plan.n)
        .map(|_| Choice {
            parser: OutputParser::new(plan.conversation.thinking),
            reasoning: String::new(),
            content: String::new(),
            calls: Vec::new(),
            finish: None,
            usage: (0, 0, 0),
        })
        .collect();
    let merged = futures::stream::select_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(i, rx)| tokio_stream::wrappers::ReceiverStream::new(rx).map(move |e| (i, e))),
    );
    if plan.stream {
        stream(state, plan, reply, choices, merged).await
    } else {
        collect(state, plan, reply, choices, merged).await
    }
}

/// The OpenAI logprobs entry of one token.
fn logprob_entry(state: &HttpState, t: &TokenOut) -> Value {
    let text = |id: u32| state.ctx.model.codec.as_ref().map(|c| c.token_text(id)).unwrap_or_default();
    let token = text(t.token_id);
    json!({"token": token, "logprob": t.logprob, "bytes": token.as_bytes(),
           "top_logprobs": t.top.iter().map(|(id, lp, _)| {
               let s = text(*id);
               json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
           }).collect::<Vec<_>>()})
}

/// Apply one reply delta to a choice; returns its `delta` object for streaming.
fn apply(choice: &mut Choice, delta: Delta, reply_id: &str, index: usize) -> Value {
    match delta {
        Delta::Reasoning(t) => {
            choice.reasoning.push_str(&t);
            json!({"reasoning_content": t})
        }
        Delta::Content(t) => {
            choice.content.push_str(&t);
            json!({"content": t})
        }
        Delta::ToolCall { name, arguments } => {
            let k = choice.calls.len();
            let id = format!("call_{}_{index}_{k}", reply_id.trim_start_matches("chatcmpl-"));
            choice.calls.push((id.clone(), name.clone(), arguments.clone()));
            json!({"tool_calls": [{"index": k, "id": id, "type": "function",
                                   "function": {"name": name, "arguments": arguments}}]})
        }
    }
}

fn finish_reason(choice: &Choice, finish: pb::FinishReason) -> &'static str {
    if !choice.calls.is_empty() {
        "tool_calls"
    } else if finish == pb::FinishReason::Stop {
        "stop"
    } else {
        "length"
    }
}

fn total_usage(choices: &[Choice]) -> Value {
    let prompt = choices.iter().map(|c| c.usage.0).max().unwrap_or(0);
    let cached = choices.iter().map(|c| c.usage.1).max().unwrap_or(0);
    let completion = choices.iter().map(|c| c.usage.2).sum();
    usage_json(prompt, cached, completion)
}

async fn collect(
    state: Arc<HttpState>,
    plan: ChatPlan,
    reply: Reply,
    mut choices: Vec<Choice>,
    mut merged: impl futures::Stream<Item = (usize, Result<Event, Status>)> + Unpin,
) -> Response {
    let want_logprobs = plan.logprobs;
    let mut token_logprobs: HashMap<usize, Vec<TokenOut>> = HashMap::new();
    while let Some((i, item)) = merged.next().await {
        let choice = &mut choices[i];
        match item {
            Ok(Event::Token(t)) => {
                for d in choice.parser.push(&t.text) {
                    apply(choice, d, &reply.id, i);
                }
                if want_logprobs {
                    token_logprobs.entry(i).or_default().push(t);
                }
            }
            Ok(Event::Final { finish, prompt_tokens, cached_tokens, completion_tokens, .. }) => {
                for d in choice.parser.finish() {
                    apply(choice, d, &reply.id, i);
                }
                choice.finish = Some(finish_reason(choice, finish));
                choice.usage = (prompt_tokens, cached_tokens, completion_tokens);
            }
            Err(s) => return status_response(&s),
        }
    }
    let body_choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut message = json!({"role": "assistant",
                "content": if c.content.is_empty() && !c.calls.is_empty() { Value::Null } else { json!(c.content) }});
            if !c.reasoning.is_empty() || plan.conversation.thinking {
                message["reasoning_content"] = json!(c.reasoning);
            }
            if !c.calls.is_empty() {
                message["tool_calls"] = c
                    .calls
                    .iter()
                    .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                    .collect();
            }
            json!({"index": i, "message": message, "logprobs": Value::Null,
                   "finish_reason": c.finish.unwrap_or("length")})
        })
        .collect();
    let mut body = json!({"id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
                          "system_fingerprint": reply.fingerprint, "choices": body_choices, "usage": total_usage(&choices)});
    for (i, tokens) in token_logprobs {
        let content: Vec<Value> = tokens.iter().map(|t| logprob_entry(&state, t)).collect();
        body["choices"][i]["logprobs"] = json!({"content": content});
    }
    Json(body).into_response()
}

async fn stream(
    state: Arc<HttpState>,
    plan: ChatPlan,
    reply: Reply,
    mut choices: Vec<Choice>,
    mut merged: impl futures::Stream<Item = (usize, Result<Event, Status>)> + Unpin + Send + 'static,
) -> Response {
    let sse = async_stream::stream! {
        for i in 0..choices.len() {
            let c = reply.chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]));
            yield Ok::<_, Infallible>(SseEvent::default().data(c.to_string()));
        }
        while let Some((i, item)) = merged.next().await {
            let choice = &mut choices[i];
            let mut out = Vec::new();
            match item {
                Ok(Event::Token(t)) => {
                    let lp = if plan.logprobs { json!({"content": [logprob_entry(&state, &t)]}) } else { Value::Null };
                    let deltas = choice.parser.push(&t.text);
                    if deltas.is_empty() && plan.logprobs {
                        out.push(json!({"index": i, "delta": {}, "logprobs": lp, "finish_reason": null}));
                    }
                    for (k, d) in deltas.into_iter().enumerate() {
                        let delta = apply(choice, d, &reply.id, i);
                        let lp = if k == 0 { lp.clone() } else { Value::Null };
                        out.push(json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": null}));
                    }
                }
                Ok(Event::Final { finish, prompt_tokens, cached_tokens, completion_tokens, .. }) => {
                    for d in choice.parser.finish() {
                        let delta = apply(choice, d, &reply.id, i);
                        out.push(json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": null}));
                    }
                    choice.usage = (prompt_tokens, cached_tokens, completion_tokens);
                    let reason = finish_reason(choice, finish);
                    choice.finish = Some(reason);
                    out.push(json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": reason}));
                }
                Err(s) => {
                    let e = json!({"error": {"message": s.message(), "type": "server_error", "param": null, "code": null}});
                    yield Ok(SseEvent::default().data(e.to_string()));
                    break;
                }
            }
            for c in out {
                yield Ok(SseEvent::default().data(reply.chunk(json!([c])).to_string()));
            }
        }
        if plan.include_usage && choices.iter().all(|c| c.finish.is_some()) {
            let mut c = reply.chunk(json!([]));
            c["usage"] = total_usage(&choices);
            yield Ok(SseEvent::default().data(c.to_string()));
        }
        yield Ok(SseEvent::default().data("[DONE]"));
    };
    Sse::new(sse).into_response()
}
