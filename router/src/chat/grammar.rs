//! The grammar a constrained request decodes under, in llguidance's Lark dialect (the
//! decode worker compiles it and masks every step's sampling with it): JSON for
//! `response_format`, V4's DSML tool-call block for `tool_choice: required` or a named
//! function. In thinking mode free reasoning comes first, closed by the `</think>` token.
//! Special tokens are referenced by id (`<[id]>`), so plain text can never spell them.

use super::convert::ToolPolicy;
use super::encoding::{Conversation, ResponseFormat, ToolSpec};
use super::pyjson::{object_members, quote};

/// Ids of the special tokens a grammar refers to.
#[derive(Clone, Copy, Debug)]
pub struct GrammarTokens {
    pub think_end: u32,
    pub dsml: u32,
}

/// The grammar for a conversation and tool policy, or `None` when decoding is free.
pub fn grammar(conv: &Conversation, policy: &ToolPolicy, t: GrammarTokens) -> Option<String> {
    let body = match policy {
        ToolPolicy::Required => tool_calls(&conv.tools, true, t),
        ToolPolicy::Named(name) => {
            tool_calls(&conv.tools.iter().filter(|x| &x.name == name).cloned().collect::<Vec<_>>(), false, t)
        }
        ToolPolicy::Auto => match &conv.response_format {
            ResponseFormat::Text => return None,
            ResponseFormat::JsonObject => {
                format!("start: body\nbody: %json {}\n", compact_json(r#"{"type": "object"}"#))
            }
            ResponseFormat::JsonSchema(schema) => format!("start: body\nbody: %json {}\n", compact_json(schema)),
        },
    };
    Some(if conv.thinking {
        // `start` becomes the answer after the reasoning.
        format!(
            "start: REASONING <[{}]> answer\nREASONING: /(.|\\n)*/\n{}",
            t.think_end,
            body.replacen("start:", "answer:", 1)
        )
    } else {
        body
    })
}

/// The DSML block: one call (`many` false) or one or more, each of a listed function with
/// its parameters in schema order (required ones always, others optionally); string
/// parameters as plain text (their enum values when given), the rest as JSON of their schema.
fn tool_calls(tools: &[ToolSpec], many: bool, t: GrammarTokens) -> String {
    let d = format!("<[{}]>", t.dsml);
    let mut g = String::new();
    let calls = if many { "(invoke \"\\n\")+" } else { "invoke \"\\n\"" };
    g.push_str(&format!("start: \"\\n\\n<\" {d} \"tool_calls>\\n\" {calls} \"</\" {d} \"tool_calls>\"\n"));
    let names: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    g.push_str(&format!("invoke: {}\n", names.join(" | ")));
    for (i, tool) in tools.iter().enumerate() {
        let params = parameters(tool.parameters.as_deref().unwrap_or("{}"));
        let mut seq = String::new();
        for (j, (key, schema, required)) in params.iter().enumerate() {
            let rule = format!("f{i}p{j}");
            seq.push_str(&if *required { format!(" {rule}") } else { format!(" {rule}?") });
            let (flag, value) = match string_values(schema) {
                Some(v) => ("true", v),
                None => ("false", format!("%json {}", compact_json(schema))),
            };
            let head = quote(&format!("parameter name=\"{key}\" string=\"{flag}\">"));
            g.push_str(&format!("{rule}: \"<\" {d} {head} {value} \"</\" {d} \"parameter>\\n\"\n"));
        }
        let head = quote(&format!("invoke name=\"{}\">\n", tool.name));
        g.push_str(&format!("f{i}: \"<\" {d} {head}{seq} \"</\" {d} \"invoke>\"\n"));
    }
    g
}

/// `schema` with llguidance's option for JSON without free whitespace, so a model cannot
/// spend its tokens on blanks.
fn compact_json(schema: &str) -> String {
    let mut parts = vec![r#""x-guidance": {"whitespace_flexible": false}"#.to_string()];
    for (k, v) in object_members(schema).unwrap_or_default() {
        if k != "x-guidance" {
            parts.push(format!("{}: {}", quote(&k), v.get()));
        }
    }
    format!("{{{}}}", parts.join(", "))
}

/// (name, schema, required) of each property of an object schema, in order.
fn parameters(schema: &str) -> Vec<(String, String, bool)> {
    let members = object_members(schema).unwrap_or_default();
    let get = |k: &str| members.iter().find(|(n, _)| n == k).map(|(_, v)| v.get().to_string());
    let required: Vec<String> = get("required").and_then(|r| serde_json::from_str(&r).ok()).unwrap_or_default();
    let props = get("properties").and_then(|p| object_members(&p)).unwrap_or_default();
    props.into_iter().map(|(k, v)| (k.clone(), v.get().to_string(), required.contains(&k))).collect()
}

/// The grammar of a string parameter's text, or `None` when the schema is not a string.
fn string_values(schema: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(schema).ok()?;
    if v.get("type")?.as_str()? != "string" {
        return None;
    }
    if let Some(options) = v.get("enum").and_then(|e| e.as_array()) {
        let alts: Vec<String> = options.iter().filter_map(|o| o.as_str()).map(quote).collect();
        if !alts.is_empty() {
            return Some(format!("({})", alts.join(" | ")));
        }
    }
    // Text up to the closing tag; bounded by maxLength when the schema gives one.
    Some(match v.get("maxLength").and_then(|m| m.as_u64()) {
        Some(n) => format!("/[^<]{{0,{n}}}/"),
        None => "/[^<]*/".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_grammars_keep_the_schema_and_drop_free_whitespace() {
        let schema = r#"{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}"#;
        let conv = Conversation {
            system: vec![],
            turns: vec![],
            tools: vec![],
            response_format: ResponseFormat::JsonSchema(schema.into()),
            thinking: false,
            effort: None,
        };
        let t = GrammarTokens { think_end: 5, dsml: 6 };
        let g = grammar(&conv, &ToolPolicy::Auto, t).unwrap();
        assert_eq!(
            g,
            "start: body\nbody: %json {\"x-guidance\": {\"whitespace_flexible\": false}, \"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}, \"required\": [\"a\"]}\n"
        );
        let thinking = grammar(&Conversation { thinking: true, ..conv }, &ToolPolicy::Auto, t).unwrap();
        assert!(
            thinking.starts_with("start: REASONING <[5]> answer\n") && thinking.contains("answer: body"),
            "{thinking}"
        );
    }
}
