//! The OpenAI chat-completions request body, as clients send it. Fields sluice does
//! not know are ignored; known fields of the wrong type fail deserialisation (a 400).
//! JSON Schemas stay raw text so that their key order reaches the prompt unchanged.

use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<Message>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// DeepSeek's API: `{"type": "enabled" | "disabled"}`; also a plain boolean.
    pub thinking: Option<Toggle>,
    /// vLLM's and SGLang's switch: `{"thinking": true}` (or `enable_thinking`).
    pub chat_template_kwargs: Option<TemplateKwargs>,
    /// `low`, `medium`, `high`, `xhigh`, `max`; `none` turns thinking off.
    pub reasoning_effort: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's extension; -1 or 0 mean no limit.
    pub top_k: Option<i32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<ResponseFormat>,
    pub user: Option<String>,
}

/// One message. A flat struct rather than an enum tagged by role: serde buffers tagged
/// enums, and raw JSON (tool-call arguments) cannot be read back from that buffer.
#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Option<Content>,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Vec<ToolCall>>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
    LatestReminder,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text {
        text: String,
    },
    #[serde(other)]
    Unsupported,
}

#[derive(Debug, Deserialize)]
pub struct ToolCall {
    pub id: Option<String>,
    pub function: FunctionCall,
}

#[derive(Debug, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON string (as OpenAI sends it) or a JSON object.
    pub arguments: Box<RawValue>,
}

#[derive(Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Box<RawValue>>,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Debug, Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Toggle {
    Flag(bool),
    Typed {
        #[serde(rename = "type")]
        kind: String,
    },
}

#[derive(Debug, Deserialize, Default)]
pub struct TemplateKwargs {
    pub thinking: Option<bool>,
    pub enable_thinking: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}` (a struct for
/// the same reason as [`Message`]).
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaSpec>,
}

#[derive(Debug, Deserialize)]
pub struct JsonSchemaSpec {
    pub name: Option<String>,
    pub schema: Option<Box<RawValue>>,
    pub strict: Option<bool>,
}

impl Content {
    /// Text parts joined as the V4 encoding joins them; `Err` names an unsupported part.
    pub fn text(&self) -> Result<String, String> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => {
                let mut texts = Vec::with_capacity(parts.len());
                for p in parts {
                    match p {
                        Part::Text { text } => texts.push(text.as_str()),
                        Part::Unsupported => {
                            return Err("only text content parts are supported (no images or audio)".into());
                        }
                    }
                }
                Ok(texts.join("\n\n"))
            }
        }
    }
}
