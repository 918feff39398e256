//! Chat completions for DeepSeek-V4: the request as OpenAI clients send it, V4's prompt
//! encoding, the grammar that enforces structured output and tool calls, and the reply
//! split into reasoning, content and tool calls. All pure; `http` and `grpc` adapt it.
//!
//! - [`request`]: the OpenAI request body (serde).
//! - [`convert`]: request → conversation + decoding plan (thinking, tools, sampling, n).
//! - [`encoding`]: conversation → prompt text, exactly as DeepSeek's reference encodes it.
//! - [`pyjson`]: JSON in Python's layout, key order kept (what the encoding embeds).
//! - [`grammar`]: the llguidance grammar of a constrained request.
//! - [`output`]: streamed reply → reasoning / content / tool-call deltas.

pub mod convert;
pub mod encoding;
pub mod grammar;
pub mod output;
pub mod pyjson;
pub mod request;

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum ChatError {
    /// Bad input; `param` names the request field, as OpenAI's errors do.
    #[error("{message}")]
    Invalid { message: String, param: Option<&'static str> },
}
