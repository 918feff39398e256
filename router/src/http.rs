//! OpenAI-compatible HTTP API: `POST /v1/completions` and `POST /v1/chat/completions`
//! (`chat_http`; streaming as server-sent events, or one JSON response), `GET /v1/models`,
//! `GET /health`. Errors use OpenAI's shape (`{"error": {"message", "type", "param",
//! "code"}}`) with the matching HTTP status; unknown paths and methods get one too.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_proto::v1 as pb;
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

use crate::model::ModelInfo;
use crate::orchestrate::{self, Event, RouterCtx};
use crate::validate::{self, Limits, Prompt, Sampling};

pub struct HttpState {
    pub ctx: Arc<RouterCtx>,
    pub limits: Limits,
}

pub fn router(state: Arc<HttpState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(crate::chat_http::chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "invalid_request_error", "no such endpoint", None, None) })
        .method_not_allowed_fallback(|| async {
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method not allowed on this endpoint",
                None,
                None,
            )
        })
        .with_state(state)
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
pub fn error(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}});
    (status, Json(body)).into_response()
}

pub fn status_response(s: &Status) -> Response {
    let (code, kind) = match s.code() {
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        Code::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error"),
        Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
        Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
        Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        Code::Cancelled => (StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST), "cancelled"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
    };
    error(code, kind, s.message(), None, None)
}

/// JSON body with OpenAI-style errors for malformed input (counted as invalid_argument).
pub struct Body<T>(pub T);

impl<T: serde::de::DeserializeOwned> FromRequest<Arc<HttpState>> for Body<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &Arc<HttpState>) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Body(v)),
            Err(e) => {
                state.ctx.metrics.outcome(Code::InvalidArgument);
                Err(error(StatusCode::BAD_REQUEST, "invalid_request_error", rejection_message(e), None, None))
            }
        }
    }
}

fn rejection_message(e: JsonRejection) -> String {
    format!("malformed request body: {}", e.body_text())
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionRequest {
    #[serde(default)]
    model: String,
    prompt: Option<PromptField>,
    #[serde(default = "default_max_tokens")]
    max_tokens: u32,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "one")]
    top_p: f32,
    #[serde(default)]
    top_k: u32,
    seed: Option<u64>,
    stop: Option<StopField>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    logprobs: Option<u32>,
    n: Option<u32>,
    user: Option<String>,
}

fn default_max_tokens() -> u32 {
    16
}

fn one() -> f32 {
    1.0
}

pub fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn finish_name(f: pb::FinishReason) -> &'static str {
    match f {
        pb::FinishReason::Stop => "stop",
        _ => "length",
    }
}

pub(crate) fn parse(
    model: &ModelInfo,
    limits: &Limits,
    r: CompletionRequest,
    request_id: String,
) -> Result<validate::Validated, Status> {
    if r.n.is_some_and(|n| n != 1) {
        return Err(Status::invalid_argument("n must be 1: one completion per request"));
    }
    let _ = r.user;
    let prompt = match r.prompt {
        None => None,
        Some(PromptField::Text(t)) => Some(Prompt::Text(t)),
        Some(PromptField::Ids(ids)) => Some(Prompt::Ids(ids)),
        Some(PromptField::Texts(mut v)) if v.len() == 1 => Some(Prompt::Text(v.remove(0))),
        Some(PromptField::IdLists(mut v)) if v.len() == 1 => Some(Prompt::Ids(v.remove(0))),
        Some(_) => {
            return Err(Status::invalid_argument("send one prompt per request (a string or a list of token ids)"));
        }
    };
    let stops = match r.stop {
        None => vec![],
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    let logprobs = r.logprobs.unwrap_or(0);
    let sampling = Sampling {
        temperature: r.temperature,
        top_p: if r.top_p == 0.0 { 1.0 } else { r.top_p },
        top_k: r.top_k,
        seed: r.seed,
        logprobs: r.logprobs.is_some(),
        top_logprobs: logprobs,
    };
    validate::validate(model, limits, request_id, &r.model, prompt, r.max_tokens, sampling, vec![], stops)
        .map_err(Status::invalid_argument)
}

fn logprobs_json(tokens: &[orchestrate::TokenOut], offset0: usize) -> Value {
    let mut offset = offset0;
    let mut offsets = Vec::with_capacity(tokens.len());
    for t in tokens {
        offsets.push(offset);
        offset += t.text.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
        "token_ids": tokens.iter().map(|t| t.token_id).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top.iter().map(|(_, lp, text)| (text.clone(), json!(*lp))).collect::<serde_json::Map<String, Value>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

async fn completions(
    State(state): State<Arc<HttpState>>,
    headers: axum::http::HeaderMap,
    Body(r): Body<CompletionRequest>,
) -> Response {
    let request_id =
        headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string).unwrap_or_else(|| "unset".into());
    let want_logprobs = r.logprobs.is_some();
    let stream = r.stream;
    let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let arrival = orchestrate::arrive(&request_id, &MetadataMap::from_headers(headers));
    let v = match parse(&state.ctx.model, &state.limits, r, request_id.clone()) {
        Ok(v) => v,
        Err(s) => return status_response(&orchestrate::refuse(&state.ctx, &arrival, s)),
    };
    let mut events = match orchestrate::start(state.ctx.clone(), v, arrival) {
        Ok(e) => e,
        Err(s) => return status_response(&s),
    };
    let id = format!("cmpl-{request_id}");
    let model = state.ctx.model.name.clone();
    let created = now_s();
    if stream {
        let sse = async_stream::stream! {
            let mut offset = 0;
            while let Some(item) = events.recv().await {
                let chunk = match item {
                    Ok(Event::Token(t)) => {
                        let lp = if want_logprobs { logprobs_json(std::slice::from_ref(&t), offset) } else { Value::Null };
                        offset += t.text.len();
                        json!({"id": id, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": 0, "text": t.text, "logprobs": lp, "finish_reason": null}]})
                    }
                    Ok(Event::Final { finish, prompt_tokens, cached_tokens, completion_tokens, .. }) => {
                        let mut c = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": finish_name(finish)}]});
                        if include_usage {
                            c["usage"] = usage_json(prompt_tokens, cached_tokens, completion_tokens);
                        }
                        c
                    }
                    Err(s) => json!({"error": {"message": s.message(), "type": "server_error", "code": s.code() as i32}}),
                };
                yield Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string()));
            }
            yield Ok(SseEvent::default().data("[DONE]"));
        };
        return Sse::new(sse).into_response();
    }
    let mut tokens = Vec::new();
    while let Some(item) = events.recv().await {
        match item {
            Ok(Event::Token(t)) => tokens.push(t),
            Ok(Event::Final { finish, prompt_tokens, cached_tokens, completion_tokens, .. }) => {
                let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
                let lp = if want_logprobs { logprobs_json(&tokens, 0) } else { Value::Null };
                let body = json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_name(finish)}],
                    "usage": usage_json(prompt_tokens, cached_tokens, completion_tokens),
                });
                return Json(body).into_response();
            }
            Err(s) => return status_response(&s),
        }
    }
    error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "the request ended without a result", None, None)
}

pub fn usage_json(prompt: u32, cached: u32, completion: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

async fn models(State(state): State<Arc<HttpState>>) -> Json<Value> {
    let m = &state.ctx.model;
    Json(json!({"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "sluice",
                                             "max_model_len": m.max_position, "context_length": m.max_position}]}))
}

async fn health(State(state): State<Arc<HttpState>>) -> Response {
    let (p, d) = state.ctx.workers.healthy_counts();
    let ok = p > 0 && d > 0;
    let body = Json(json!({"status": if ok { "ok" } else { "degraded" }, "prefill_workers": p, "decode_workers": d}));
    let code = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, body).into_response()
}
