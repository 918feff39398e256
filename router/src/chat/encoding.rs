//! DeepSeek-V4's prompt encoding: a conversation → the prompt text the model was trained
//! on (special tokens spelled out; the model's tokenizer turns them into their ids).
//! Token-exact against DeepSeek's reference encoder on the fixtures in
//! `router/tests/golden/chat_encoding.json` (see tools/golden/chat).
//!
//! Layout: BOS, the reasoning-effort preamble (thinking mode), the system prompt (system
//! messages, then the tool section, then the response-format section), then the turns:
//! `<｜User｜>…` (tool results merged in as `<tool_result>` blocks in call order),
//! `<｜latest_reminder｜>…`, `<｜Assistant｜>` + marker + reply + EOS, and a final
//! `<｜Assistant｜>` + marker that opens the generation. The marker is `<think>` in
//! thinking mode where reasoning is kept and `</think>` otherwise; earlier turns' reasoning
//! is dropped unless the request has tools (an agent loop needs its reasoning back).

use super::pyjson::{object_members, python_json, quote};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
pub const DSML: &str = "｜DSML｜";
pub const LATEST_REMINDER: &str = "<｜latest_reminder｜>";

/// The special tokens every chat prompt uses; a tokenizer without them cannot encode one.
pub const REQUIRED_TOKENS: [&str; 7] = [BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML];

const EFFORT_HIGH: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

const EFFORT_MAX: &str = "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n\
You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any surface symptom.\n\
Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

const TOOLS_HEAD: &str = "## Tools\n\n\
You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after </think> with tool calls or final response.\n\n\
### Available Tool Schemas\n\n";

const TOOLS_TAIL: &str =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

const JSON_OBJECT_FORMAT: &str =
    "You are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY.";
const JSON_SCHEMA_FORMAT: &str = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

/// How hard the model should think (thinking mode only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    Low,
    High,
    Max,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    /// The schema as the client sent it (raw JSON text).
    JsonSchema(String),
}

/// A tool the model may call: name, description and parameter schema (raw JSON text).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<String>,
    pub strict: bool,
}

/// A call the assistant made earlier; `arguments` is raw JSON (a string or an object).
#[derive(Clone, Debug, PartialEq)]
pub struct PastCall {
    pub id: Option<String>,
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Turn {
    User(String),
    ToolResult { call_id: Option<String>, content: String },
    Assistant { content: String, reasoning: Option<String>, calls: Vec<PastCall> },
    LatestReminder(String),
}

/// A conversation ready to encode: system text apart, the rest in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub system: Vec<String>,
    pub turns: Vec<Turn>,
    pub tools: Vec<ToolSpec>,
    pub response_format: ResponseFormat,
    pub thinking: bool,
    /// `None` in thinking mode means the default (`High`).
    pub effort: Option<Effort>,
}

/// One user turn after merging: text and tool results, in order.
enum Block<'a> {
    User(Vec<UserPart<'a>>),
    Assistant { content: &'a str, reasoning: Option<&'a str>, calls: &'a [PastCall] },
    Reminder(&'a str),
}

enum UserPart<'a> {
    Text(&'a str),
    Result { call_id: Option<&'a str>, content: &'a str },
}

impl Conversation {
    /// The prompt text, ending with the header of the assistant turn to generate.
    pub fn render(&self) -> String {
        let keep_reasoning = self.thinking && !self.tools.is_empty();
        let marker = if keep_reasoning { THINK_START } else { THINK_END };
        let mut out = String::from(BOS);
        if self.thinking {
            match self.effort.unwrap_or(Effort::High) {
                Effort::Low => {}
                Effort::High => out.push_str(EFFORT_HIGH),
                Effort::Max => out.push_str(EFFORT_MAX),
            }
        }
        out.push_str(&self.system_prompt());
        for block in self.blocks() {
            match block {
                Block::User(parts) => {
                    out.push_str(USER);
                    let texts: Vec<String> = parts
                        .iter()
                        .map(|p| match p {
                            UserPart::Text(t) => t.to_string(),
                            UserPart::Result { content, .. } => format!("<tool_result>{content}</tool_result>"),
                        })
                        .collect();
                    out.push_str(&texts.join("\n\n"));
                }
                Block::Reminder(text) => {
                    out.push_str(LATEST_REMINDER);
                    out.push_str(text);
                }
                Block::Assistant { content, reasoning, calls } => {
                    out.push_str(ASSISTANT);
                    out.push_str(marker);
                    if keep_reasoning {
                        out.push_str(reasoning.unwrap_or(""));
                        out.push_str(THINK_END);
                    }
                    out.push_str(content);
                    if !calls.is_empty() {
                        out.push_str(&render_calls(calls));
                    }
                    out.push_str(EOS);
                }
            }
        }
        out.push_str(ASSISTANT);
        out.push_str(if self.thinking { THINK_START } else { THINK_END });
        out
    }

    fn system_prompt(&self) -> String {
        let mut s = self.system.join("\n\n");
        if !self.tools.is_empty() {
            s.push_str("\n\n");
            s.push_str(TOOLS_HEAD);
            let schemas: Vec<String> = self.tools.iter().map(render_tool).collect();
            s.push_str(&schemas.join("\n"));
            s.push_str(TOOLS_TAIL);
        }
        match &self.response_format {
            ResponseFormat::Text => {}
            ResponseFormat::JsonObject => {
                s.push_str("\n\n");
                s.push_str(JSON_OBJECT_FORMAT);
            }
            ResponseFormat::JsonSchema(schema) => {
                s.push_str("\n\n");
                s.push_str(JSON_SCHEMA_FORMAT);
                s.push_str(&python_json(schema).unwrap_or_else(|_| schema.clone()));
            }
        }
        s
    }

    /// Turns with consecutive user text and tool results merged into one user turn, the
    /// results in the order of the calls that asked for them.
    fn blocks(&self) -> Vec<Block<'_>> {
        let mut blocks: Vec<Block> = Vec::new();
        let mut call_order: Vec<&str> = Vec::new();
        for turn in &self.turns {
            let part = match turn {
                Turn::User(t) => UserPart::Text(t),
                Turn::ToolResult { call_id, content } => UserPart::Result { call_id: call_id.as_deref(), content },
                Turn::Assistant { content, reasoning, calls } => {
                    // The results before this turn answer the previous turn's calls.
                    if let Some(Block::User(parts)) = blocks.last_mut() {
                        sort_results(parts, &call_order);
                    }
                    if !calls.is_empty() {
                        call_order = calls.iter().filter_map(|c| c.id.as_deref()).collect();
                    }
                    blocks.push(Block::Assistant { content, reasoning: reasoning.as_deref(), calls });
                    continue;
                }
                Turn::LatestReminder(t) => {
                    if let Some(Block::User(parts)) = blocks.last_mut() {
                        sort_results(parts, &call_order);
                    }
                    blocks.push(Block::Reminder(t));
                    continue;
                }
            };
            match blocks.last_mut() {
                Some(Block::User(parts)) => parts.push(part),
                _ => blocks.push(Block::User(vec![part])),
            }
        }
        if let Some(Block::User(parts)) = blocks.last_mut() {
            sort_results(parts, &call_order);
        }
        blocks
    }
}

/// Reorder the tool results of a user turn by call position (unknown ids first, as
/// position 0), leaving text parts where they are.
fn sort_results(parts: &mut [UserPart<'_>], call_order: &[&str]) {
    let position = |id: Option<&str>| id.and_then(|id| call_order.iter().position(|c| *c == id)).unwrap_or(0);
    let slots: Vec<usize> = (0..parts.len()).filter(|&i| matches!(parts[i], UserPart::Result { .. })).collect();
    if slots.len() < 2 || call_order.is_empty() {
        return;
    }
    let mut results: Vec<(usize, Option<&str>, &str)> = slots
        .iter()
        .map(|&i| match parts[i] {
            UserPart::Result { call_id, content } => (position(call_id), call_id, content),
            UserPart::Text(_) => unreachable!("slots hold results only"),
        })
        .collect();
    results.sort_by_key(|r| r.0);
    for (slot, (_, call_id, content)) in slots.into_iter().zip(results) {
        parts[slot] = UserPart::Result { call_id, content };
    }
}

fn render_tool(tool: &ToolSpec) -> String {
    let params = match &tool.parameters {
        None => "{}".to_string(),
        Some(raw) if tool.strict => strict_parameters(raw).unwrap_or_else(|| python_json(raw).unwrap_or_default()),
        Some(raw) => python_json(raw).unwrap_or_else(|_| raw.clone()),
    };
    format!(
        "{{\"name\": {}, \"description\": {}, \"parameters\": {params}}}",
        quote(&tool.name),
        quote(tool.description.as_deref().unwrap_or(""))
    )
}

/// Strict function schemas as OpenAI defines them: no extra properties, every one required.
fn strict_parameters(raw: &str) -> Option<String> {
    let members = object_members(raw)?;
    let properties =
        members.iter().find(|(k, _)| k == "properties").and_then(|(_, v)| object_members(v.get())).unwrap_or_default();
    let mut parts: Vec<String> = members
        .iter()
        .filter(|(k, _)| k != "additionalProperties" && k != "required")
        .map(|(k, v)| Some(format!("{}: {}", quote(k), python_json(v.get()).ok()?)))
        .collect::<Option<_>>()?;
    parts.push("\"additionalProperties\": false".into());
    let required: Vec<String> = properties.iter().map(|(k, _)| quote(k)).collect();
    parts.push(format!("\"required\": [{}]", required.join(", ")));
    Some(format!("{{{}}}", parts.join(", ")))
}

/// `\n\n<｜DSML｜tool_calls>` … `</｜DSML｜tool_calls>` for an assistant turn's calls.
pub fn render_calls(calls: &[PastCall]) -> String {
    let invokes: Vec<String> = calls
        .iter()
        .map(|c| {
            let mut s = format!("<{DSML}invoke name=\"{}\">\n", c.name);
            for (key, value, is_string) in call_parameters(&c.arguments) {
                s.push_str(&format!(
                    "<{DSML}parameter name=\"{key}\" string=\"{is_string}\">{value}</{DSML}parameter>\n"
                ));
            }
            s.push_str(&format!("</{DSML}invoke>"));
            s
        })
        .collect();
    format!("\n\n<{DSML}tool_calls>\n{}\n</{DSML}tool_calls>", invokes.join("\n"))
}

/// The DSML parameters of raw JSON arguments: each member of the object, strings as
/// they are and other values as JSON; arguments that are no object become one string
/// parameter named `arguments`.
fn call_parameters(raw: &str) -> Vec<(String, String, bool)> {
    let text = serde_json::from_str::<String>(raw).ok();
    let object = object_members(text.as_deref().unwrap_or(raw));
    match object {
        Some(members) => members
            .into_iter()
            .map(|(k, v)| match serde_json::from_str::<String>(v.get()) {
                Ok(s) => (k, s, true),
                Err(_) => (k, python_json(v.get()).unwrap_or_else(|_| v.get().to_string()), false),
            })
            .collect(),
        None => vec![("arguments".into(), text.unwrap_or_else(|| raw.to_string()), true)],
    }
}
