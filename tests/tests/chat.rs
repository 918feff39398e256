//! `/v1/chat/completions` through the official `openai` Python SDK (pinned, installed
//! into `target/pytools-venv` on first use) against a real cluster with API keys on.
//! The model has random weights, so the checks are of structure: what the SDK parses,
//! that grammar-constrained output (JSON schemas, forced tool calls) is valid every time,
//! usage and finish reasons, `n` choices, logprobs, and OpenAI-shaped errors.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use sluice_e2e::pytools::{bounded, pytools};
use sluice_e2e::{Spec, TestCluster};
use sluice_proto::v1 as pb;

const KEY: &str = "sk-test-chat";

/// The error object of a failed call (the SDK keeps either the body or its `error`).
fn error_of(r: &Value) -> &Value {
    let body = &r["body"];
    if body.get("error").is_some() { &body["error"] } else { body }
}

fn ok<'a>(results: &'a Value, case: &str) -> &'a Value {
    let r = &results[case];
    assert!(r.get("ok").is_some(), "{case} failed: {r}");
    &r["ok"]
}

fn check_person(content: &str) {
    let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("not JSON ({e}): {content:?}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {v}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "name", "tags"], "{v}");
    assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 10), "{v}");
    assert!(v["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
    let tags = v["tags"].as_array().unwrap_or_else(|| panic!("tags: {v}"));
    assert!(tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"), "{v}");
}

/// A gRPC request carrying the test's API key (the router asks for it on gRPC too).
fn keyed<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_chat_tools_json_schema_streaming_and_errors() {
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("keys");
    std::fs::write(&key_file, format!("# test keys\n{KEY}\n")).unwrap();
    let mut spec = Spec::new(1, 1);
    spec.router_args = vec!["--api-keys-file".into(), key_file.display().to_string()];
    let c = TestCluster::start(spec).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("py/openai_chat.py");
    let base = format!("http://{}/v1", c.http);
    let ran = tokio::task::block_in_place(|| {
        let tools = pytools();
        bounded(Command::new(tools.python()).arg(&script).arg(&base).arg(KEY), Duration::from_secs(600))
    });
    assert!(ran.success(), "the SDK script failed:\n{}", ran.output());
    let results: Value = serde_json::from_str(ran.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", ran.output()));

    // A plain chat.
    let chat = ok(&results, "chat");
    assert_eq!(chat["object"], "chat.completion");
    assert!(chat["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(chat["model"], "tiny");
    assert!(chat["created"].as_u64().unwrap() > 1_600_000_000);
    assert!(chat["system_fingerprint"].as_str().is_some_and(|f| !f.is_empty()), "{chat}");
    let choice = &chat["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let usage = &chat["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&completion), "{usage}");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), usage["prompt_tokens"].as_u64().unwrap() + completion);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64(), "{usage}");

    // Streaming with usage: a role chunk first, one finish, then the usage chunk.
    let chunks = ok(&results, "stream").as_array().unwrap();
    assert!(chunks.iter().all(|ch| ch["object"] == "chat.completion.chunk" && ch["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let finishes: Vec<&Value> =
        chunks.iter().filter_map(|ch| ch["choices"].get(0)).filter(|c| !c["finish_reason"].is_null()).collect();
    assert_eq!(finishes.len(), 1, "one finish reason");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0, "usage chunk has no choices");
    let streamed = last["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&streamed), "{last}");

    // A named tool: the grammar forces exactly that call.
    let named = &ok(&results, "tool_named")["choices"][0];
    assert_eq!(named["finish_reason"], "tool_calls", "{named}");
    let calls = named["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{named}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_time");
    assert_eq!(calls[0]["function"]["arguments"], "{}");
    assert!(calls[0]["id"].as_str().is_some_and(|id| !id.is_empty()));

    // `required`, streamed: every call is a well-formed get_weather call.
    let chunks = ok(&results, "tool_required_stream").as_array().unwrap();
    let mut calls = Vec::new();
    let mut finish = None;
    for ch in chunks {
        if let Some(c) = ch["choices"].get(0) {
            calls.extend(c["delta"]["tool_calls"].as_array().into_iter().flatten().cloned());
            if !c["finish_reason"].is_null() {
                finish = Some(c["finish_reason"].clone());
            }
        }
    }
    assert_eq!(finish, Some(Value::from("tool_calls")), "{chunks:?}");
    assert!(!calls.is_empty());
    for call in &calls {
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{args}");
        assert!(args["unit"] == "celsius" || args["unit"] == "fahrenheit", "{args}");
    }

    // JSON schema: the constrained output parses and fits the schema, every time.
    for reply in ok(&results, "json_schema").as_array().unwrap() {
        let choice = &reply["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{choice}");
        check_person(choice["message"]["content"].as_str().unwrap());
    }
    // Any JSON object: a random model may not close it within max_tokens, but what it
    // wrote is an object's beginning, and a finished one parses.
    let obj = &ok(&results, "json_object")["choices"][0];
    let content = obj["message"]["content"].as_str().unwrap();
    assert!(content.starts_with('{'), "{obj}");
    if obj["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(content).unwrap().is_object(), "{obj}");
    } else {
        assert_eq!(obj["finish_reason"], "length", "{obj}");
    }

    // n = 2 with logprobs.
    let n2 = ok(&results, "n2_logprobs");
    let choices = n2["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut total = 0;
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        let lps = ch["logprobs"]["content"].as_array().unwrap();
        assert!(!lps.is_empty() && lps.len() <= 5);
        total += lps.len() as u64;
        for lp in lps {
            assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
            assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 2);
        }
    }
    assert_eq!(n2["usage"]["completion_tokens"].as_u64().unwrap(), total);

    // Thinking on: the reply starts as reasoning.
    let thinking = &ok(&results, "thinking")["choices"][0]["message"];
    assert!(thinking["reasoning_content"].is_string(), "{thinking}");

    let models = ok(&results, "models");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert!(models["data"][0]["context_length"].as_u64().unwrap() >= 4096);

    // Errors: OpenAI's shape and status codes.
    for (case, status, needle, param) in [
        ("bad_type", 400, "malformed request body", None),
        ("bad_model", 400, "unknown model `gpt-4`", None),
        ("bad_tool_choice", 400, "not among the tools", Some("tool_choice")),
        ("bad_key", 401, "API key is not valid", None),
    ] {
        let r = &results[case];
        assert_eq!(r["status"], status, "{case}: {r}");
        let e = error_of(r);
        assert!(e["message"].as_str().unwrap_or_default().contains(needle), "{case}: {e}");
        assert!(e["type"].is_string(), "{case}: {e}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{case}: {e}");
        }
    }
    // The gRPC twin: a named tool call arrives as a tool-call event, then the final.
    let req = pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "What time is it?".into(),
            ..Default::default()
        }],
        tools: vec![pb::ToolDefinition { name: "get_time".into(), ..Default::default() }],
        tool_choice: "get_time".into(),
        max_tokens: 200,
        ..Default::default()
    };
    let mut stream = c.client().await.chat(keyed(req)).await.expect("grpc chat").into_inner();
    let mut events = Vec::new();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(60), stream.message()).await.unwrap().unwrap() {
        events.push(ev.event.expect("an event"));
    }
    let calls: Vec<&pb::ToolCall> =
        events.iter().filter_map(|e| if let pb::chat_event::Event::ToolCall(t) = e { Some(t) } else { None }).collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!((calls[0].name.as_str(), calls[0].arguments.as_str()), ("get_time", "{}"));
    match events.last() {
        Some(pb::chat_event::Event::Final(f)) => {
            assert_eq!(f.finish_reason, "tool_calls");
            assert!(f.usage.as_ref().is_some_and(|u| u.prompt_tokens > 0 && u.completion_tokens > 0));
        }
        other => panic!("last event {other:?}"),
    }
    let bad = pb::ChatRequest {
        messages: vec![pb::ChatMessage { role: "wizard".into(), ..Default::default() }],
        ..Default::default()
    };
    let err = c.client().await.chat(keyed(bad.clone())).await.expect_err("an unknown role");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("unknown message role `wizard`"), "{err:?}");

    // Without a key both APIs refuse; health stays open.
    let err = c.client().await.chat(bad).await.expect_err("no API key");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    let (status, body) =
        c.http_post("/v1/chat/completions", r#"{"messages":[{"role":"user","content":"hi"}]}"#).await.unwrap();
    assert_eq!(status, 401, "{body}");
    assert_eq!(c.http_get("/health").await.unwrap().0, 200);
    c.assert_pages_return(Duration::from_secs(5)).await;
}
