//! An OpenAI chat request → a V4 conversation and the decoding plan around it
//! (thinking mode, tool policy, sampling, how many choices). Pure: no I/O.

use super::ChatError;
use super::encoding::{Conversation, Effort, PastCall, ResponseFormat, ToolSpec, Turn};
use super::request::{self, ChatRequest, Role, Stop, Toggle, ToolChoice};

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;

#[derive(Clone, Debug, PartialEq)]
pub enum ToolPolicy {
    /// The model may answer or call tools (or there are no tools).
    Auto,
    /// At least one call, enforced while decoding.
    Required,
    /// Exactly one call of this function, enforced while decoding.
    Named(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatPlan {
    pub model: String,
    pub conversation: Conversation,
    pub tool_policy: ToolPolicy,
    /// `max_completion_tokens` or `max_tokens`; `None` fills what the context leaves.
    pub max_tokens: Option<u32>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub n: u32,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub stream: bool,
    pub include_usage: bool,
}

fn invalid(param: &'static str, message: impl Into<String>) -> ChatError {
    ChatError::Invalid { message: message.into(), param: Some(param) }
}

fn thinking_of(t: &Toggle) -> Result<bool, ChatError> {
    match t {
        Toggle::Flag(b) => Ok(*b),
        Toggle::Typed { kind } if kind == "enabled" => Ok(true),
        Toggle::Typed { kind } if kind == "disabled" => Ok(false),
        Toggle::Typed { kind } => {
            Err(invalid("thinking", format!("thinking.type must be `enabled` or `disabled`, got `{kind}`")))
        }
    }
}

/// Whether the request asks for thinking, and at what effort. Off unless asked for
/// (`thinking`, `chat_template_kwargs.thinking` or `.enable_thinking`); `reasoning_effort:
/// "none"` turns it off.
fn thinking_and_effort(r: &ChatRequest) -> Result<(bool, Option<Effort>), ChatError> {
    let kwargs = r.chat_template_kwargs.as_ref();
    let mut on = match &r.thinking {
        Some(t) => thinking_of(t)?,
        None => false,
    };
    on |= kwargs.and_then(|k| k.thinking).unwrap_or(false) || kwargs.and_then(|k| k.enable_thinking).unwrap_or(false);
    let effort = match r.reasoning_effort.as_deref() {
        None => None,
        Some("none") => return Ok((false, None)),
        Some("low" | "minimal") => Some(Effort::Low),
        Some("medium" | "high" | "xhigh") => Some(Effort::High),
        Some("max") => Some(Effort::Max),
        Some(other) => {
            return Err(invalid(
                "reasoning_effort",
                format!("reasoning_effort must be one of none, low, medium, high, xhigh, max; got `{other}`"),
            ));
        }
    };
    Ok((on, effort))
}

fn valid_tool_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn text(c: &request::Content) -> Result<String, ChatError> {
    c.text().map_err(|m| invalid("messages", m))
}

/// Check a chat request and turn it into a plan.
pub fn plan(r: ChatRequest) -> Result<ChatPlan, ChatError> {
    if r.messages.is_empty() {
        return Err(invalid("messages", "messages must hold at least one message"));
    }
    let (thinking, effort) = thinking_and_effort(&r)?;
    let mut tools = Vec::new();
    for t in r.tools.iter().flatten() {
        if t.kind != "function" {
            return Err(invalid("tools", format!("tool type `{}` is not supported; use `function`", t.kind)));
        }
        if !valid_tool_name(&t.function.name) {
            return Err(invalid(
                "tools",
                format!("tool name `{}` must be 1-64 letters, digits, `_` or `-`", t.function.name),
            ));
        }
        tools.push(ToolSpec {
            name: t.function.name.clone(),
            description: t.function.description.clone(),
            parameters: t.function.parameters.as_ref().map(|p| p.get().to_string()),
            strict: t.function.strict.unwrap_or(false),
        });
    }
    let tool_policy = match &r.tool_choice {
        None => ToolPolicy::Auto,
        Some(ToolChoice::Mode(m)) => match m.as_str() {
            "auto" => ToolPolicy::Auto,
            "none" => {
                tools.clear();
                ToolPolicy::Auto
            }
            "required" => ToolPolicy::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!("tool_choice must be auto, none, required or a function; got `{other}`"),
                ));
            }
        },
        Some(ToolChoice::Named { function }) => {
            if !tools.iter().any(|t| t.name == function.name) {
                return Err(invalid(
                    "tool_choice",
                    format!("tool_choice names `{}`, which is not among the tools", function.name),
                ));
            }
            ToolPolicy::Named(function.name.clone())
        }
    };
    if tool_policy != ToolPolicy::Auto && tools.is_empty() {
        return Err(invalid("tool_choice", "tool_choice requires a call, but the request has no tools"));
    }
    let mut system = Vec::new();
    let mut turns = Vec::new();
    for m in &r.messages {
        let content = |m: &request::Message| match &m.content {
            Some(c) => text(c),
            None => Ok(String::new()),
        };
        match m.role {
            Role::System | Role::Developer => system.push(content(m)?),
            Role::User => turns.push(Turn::User(content(m)?)),
            Role::Tool => turns.push(Turn::ToolResult { call_id: m.tool_call_id.clone(), content: content(m)? }),
            Role::LatestReminder => turns.push(Turn::LatestReminder(content(m)?)),
            Role::Assistant => {
                let calls = m
                    .tool_calls
                    .iter()
                    .flatten()
                    .map(|c| PastCall {
                        id: c.id.clone(),
                        name: c.function.name.clone(),
                        arguments: c.function.arguments.get().to_string(),
                    })
                    .collect();
                turns.push(Turn::Assistant { content: content(m)?, reasoning: m.reasoning_content.clone(), calls });
            }
        }
    }
    let response_format = match r.response_format.as_ref().map(|f| (f.kind.as_str(), f)) {
        None | Some(("text", _)) => ResponseFormat::Text,
        Some(("json_object", _)) => {
            let mentions_json = system.iter().chain(turns.iter().filter_map(|t| match t {
                Turn::User(s) | Turn::LatestReminder(s) => Some(s),
                _ => None,
            }));
            if !mentions_json.into_iter().any(|s| s.to_lowercase().contains("json")) {
                return Err(invalid(
                    "response_format",
                    "'messages' must contain the word 'json' in some form to use 'response_format' of type 'json_object'",
                ));
            }
            ResponseFormat::JsonObject
        }
        Some(("json_schema", f)) => match f.json_schema.as_ref().and_then(|s| s.schema.as_ref()) {
            Some(s) if s.get().trim_start().starts_with('{') => ResponseFormat::JsonSchema(s.get().to_string()),
            _ => return Err(invalid("response_format", "response_format.json_schema.schema must be a JSON object")),
        },
        Some((other, _)) => {
            return Err(invalid(
                "response_format",
                format!("response_format.type must be text, json_object or json_schema; got `{other}`"),
            ));
        }
    };
    let n = r.n.unwrap_or(1);
    if n == 0 || n > MAX_CHOICES {
        return Err(invalid("n", format!("n must be between 1 and {MAX_CHOICES}, got {n}")));
    }
    let top_logprobs = r.top_logprobs.unwrap_or(0);
    let logprobs = r.logprobs.unwrap_or(false);
    if top_logprobs > 0 && !logprobs {
        return Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"));
    }
    let top_k = match r.top_k {
        None => 0,
        Some(k) if k <= 0 => 0,
        Some(k) => k as u32,
    };
    let stop = match r.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", format!("temperature must be between 0 and 2, got {temperature}")));
    }
    Ok(ChatPlan {
        model: r.model,
        conversation: Conversation { system, turns, tools, response_format, thinking, effort },
        tool_policy,
        max_tokens: r.max_completion_tokens.or(r.max_tokens),
        temperature,
        top_p: match r.top_p {
            Some(p) if p > 0.0 => p,
            Some(p) if p < 0.0 => return Err(invalid("top_p", format!("top_p must be in (0, 1], got {p}"))),
            _ => 1.0,
        },
        top_k,
        seed: r.seed,
        stop,
        n,
        logprobs,
        top_logprobs,
        stream: r.stream,
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
    })
}
