//! What clients send, decoded and checked as the APIs do it but without a connection or
//! a worker: the gRPC `GenerateRequest` and `ChatRequest` and the JSON bodies of
//! `/v1/completions` and `/v1/chat/completions`. The fuzz targets (`fuzz/`) drive
//! these; each is the function its adapter (`grpc`, `http`, `chat_http`, `chat_grpc`)
//! calls, so what the fuzzer proves of them holds for the served API.

use sluice_proto::v1 as pb;

pub use crate::chat::convert::ChatPlan;
pub use crate::model::{ChatTokens, ModelInfo, chat_tokens};
pub use crate::validate::{Limits, MAX_TOP_LOGPROBS, Prompt, Sampling, Validated, validate};

/// A `/v1/completions` body: parsed as the HTTP API parses it (unknown fields refused),
/// then checked. `Err` is the message the client gets.
pub fn completion_body(model: &ModelInfo, limits: &Limits, body: &[u8]) -> Result<Validated, String> {
    let r = serde_json::from_slice(body).map_err(|e| format!("malformed request body: {e}"))?;
    crate::http::parse(model, limits, r, "completion".into()).map_err(|s| s.message().to_string())
}

/// A gRPC `Generate` request, checked.
pub fn generate_request(model: &ModelInfo, limits: &Limits, r: pb::GenerateRequest) -> Result<Validated, String> {
    crate::validate::from_proto(model, limits, r, "generate".into())
}

/// A `/v1/chat/completions` body as a plan (conversation, tool policy, sampling).
pub fn chat_body(body: &[u8]) -> Result<ChatPlan, String> {
    let r = serde_json::from_slice(body).map_err(|e| format!("malformed request body: {e}"))?;
    crate::chat::convert::plan(r).map_err(|e| e.to_string())
}

/// A gRPC `Chat` request as a plan: the proto becomes the HTTP request type first.
pub fn chat_request(r: pb::ChatRequest) -> Result<ChatPlan, String> {
    let r = crate::chat_grpc::to_request(r).map_err(|s| s.message().to_string())?;
    crate::chat::convert::plan(r).map_err(|e| e.to_string())
}
