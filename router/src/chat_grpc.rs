//! `sluice.v1.Generation/Chat`: the gRPC twin of `/v1/chat/completions`. The proto request
//! becomes the same [`ChatRequest`] the HTTP API parses, so both share planning, encoding,
//! grammars and reply parsing.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use serde_json::value::RawValue;
use sluice_proto::v1 as pb;
use tonic::Status;

use crate::chat::output::{Delta, OutputParser};
use crate::chat::request::{
    ChatRequest, Content, FunctionCall, FunctionDef, JsonSchemaSpec, Message, NamedFunction, ResponseFormat, Role,
    TemplateKwargs, Tool, ToolCall, ToolChoice,
};
use crate::orchestrate::{Event, Events};

pub type ChatStream = Pin<Box<dyn Stream<Item = Result<pb::ChatEvent, Status>> + Send>>;

fn raw(what: &str, text: &str) -> Result<Box<RawValue>, Status> {
    RawValue::from_string(text.to_string()).map_err(|e| Status::invalid_argument(format!("{what} is not JSON: {e}")))
}

fn role(r: &str) -> Result<Role, Status> {
    Ok(match r {
        "system" => Role::System,
        "developer" => Role::Developer,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        "latest_reminder" => Role::LatestReminder,
        other => return Err(Status::invalid_argument(format!("unknown message role `{other}`"))),
    })
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// The proto request as the HTTP API's request body.
pub fn to_request(r: pb::ChatRequest) -> Result<ChatRequest, Status> {
    let mut messages = Vec::with_capacity(r.messages.len());
    for m in r.messages {
        let mut calls = Vec::with_capacity(m.tool_calls.len());
        for c in m.tool_calls {
            let args = serde_json::to_string(&c.arguments).expect("a string serialises");
            calls.push(ToolCall {
                id: non_empty(c.id),
                function: FunctionCall { name: c.name, arguments: raw("tool call arguments", &args)? },
            });
        }
        messages.push(Message {
            role: role(&m.role)?,
            content: Some(Content::Text(m.content)),
            reasoning_content: non_empty(m.reasoning_content),
            tool_calls: (!calls.is_empty()).then_some(calls),
            tool_call_id: non_empty(m.tool_call_id),
        });
    }
    let mut tools = Vec::with_capacity(r.tools.len());
    for t in r.tools {
        let parameters = match t.parameters_json.is_empty() {
            true => None,
            false => Some(raw("tool parameters", &t.parameters_json)?),
        };
        tools.push(Tool {
            kind: "function".into(),
            function: FunctionDef {
                name: t.name,
                description: non_empty(t.description),
                parameters,
                strict: Some(t.strict),
            },
        });
    }
    let tool_choice = match r.tool_choice.as_str() {
        "" => None,
        "auto" | "none" | "required" => Some(ToolChoice::Mode(r.tool_choice)),
        _ => Some(ToolChoice::Named { function: NamedFunction { name: r.tool_choice } }),
    };
    let response_format = match r.response_format {
        None => None,
        Some(f) => Some(ResponseFormat {
            json_schema: match f.json_schema.is_empty() {
                true => None,
                false => Some(JsonSchemaSpec {
                    name: None,
                    schema: Some(raw("response_format.json_schema", &f.json_schema)?),
                    strict: None,
                }),
            },
            kind: if f.r#type.is_empty() { "text".into() } else { f.r#type },
        }),
    };
    let s = r.sampling;
    Ok(ChatRequest {
        model: r.model,
        messages,
        tools: Some(tools),
        tool_choice,
        thinking: None,
        chat_template_kwargs: Some(TemplateKwargs { thinking: Some(r.thinking), enable_thinking: None }),
        reasoning_effort: non_empty(r.reasoning_effort),
        max_tokens: (r.max_tokens > 0).then_some(r.max_tokens),
        max_completion_tokens: None,
        temperature: Some(s.as_ref().map_or(1.0, |s| s.temperature)),
        top_p: s.as_ref().map(|s| s.top_p),
        top_k: s.as_ref().map(|s| s.top_k as i32),
        seed: s.as_ref().and_then(|s| s.seed),
        stop: Some(crate::chat::request::Stop::Many(r.stop)),
        n: Some(r.n.max(1)),
        logprobs: s.as_ref().map(|s| s.logprobs || s.top_logprobs > 0),
        top_logprobs: s.as_ref().map(|s| s.top_logprobs),
        stream: true,
        stream_options: None,
        response_format,
        user: None,
    })
}

/// The choices' events as chat events: deltas as they are parsed, then each choice's final.
pub fn events(streams: Vec<Events>, thinking: bool) -> ChatStream {
    let n = streams.len();
    let merged = futures::stream::select_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(i, rx)| tokio_stream::wrappers::ReceiverStream::new(rx).map(move |e| (i, e))),
    );
    let mut parsers: Vec<OutputParser> = (0..n).map(|_| OutputParser::new(thinking)).collect();
    let out = merged.flat_map(move |(i, item)| {
        let choice = i as u32;
        let ev = |event| Ok(pb::ChatEvent { choice, event: Some(event) });
        let to_event = |d: Delta| match d {
            Delta::Reasoning(t) => pb::chat_event::Event::ReasoningDelta(t),
            Delta::Content(t) => pb::chat_event::Event::ContentDelta(t),
            Delta::ToolCall { name, arguments } => {
                pb::chat_event::Event::ToolCall(pb::ToolCall { id: format!("call_{choice}_{name}"), name, arguments })
            }
        };
        let parser = &mut parsers[i];
        let items: Vec<Result<pb::ChatEvent, Status>> = match item {
            Ok(Event::Token(t)) => parser.push(&t.text).into_iter().map(|d| ev(to_event(d))).collect(),
            Ok(Event::Final { finish, prompt_tokens, cached_tokens, completion_tokens, .. }) => {
                let mut v: Vec<_> = parser.finish().into_iter().map(|d| ev(to_event(d))).collect();
                let reason = if parser.tool_calls() > 0 {
                    "tool_calls"
                } else if finish == pb::FinishReason::Stop {
                    "stop"
                } else {
                    "length"
                };
                v.push(ev(pb::chat_event::Event::Final(pb::ChatFinal {
                    finish_reason: reason.into(),
                    usage: Some(pb::Usage { prompt_tokens, cached_tokens, completion_tokens }),
                })));
                v
            }
            Err(s) => vec![Err(s)],
        };
        futures::stream::iter(items)
    });
    Box::pin(out)
}
