"""Drives a sluice router with the official `openai` SDK (tests/tests/chat.rs runs it).

Usage: python openai_chat.py BASE_URL API_KEY
Prints one JSON object: what each call returned (the SDK's parsed objects, dumped), or
the error it raised, keyed by case name. The Rust test judges the results.
"""

import json
import sys

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
out = {"sdk_version": openai.__version__}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


def record(name, fn):
    try:
        out[name] = {"ok": fn()}
    except openai.APIStatusError as e:
        out[name] = {"status": e.status_code, "body": e.body}
    except Exception as e:  # noqa: BLE001 - reported to the Rust side
        out[name] = {"exception": f"{type(e).__name__}: {e}"}


record("chat", lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0).model_dump())
record(
    "stream",
    lambda: [
        c.model_dump()
        for c in client.chat.completions.create(
            model="tiny", messages=USER, max_completion_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    ],
)
record(
    "tool_named",
    lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=200,
    ).model_dump(),
)
record(
    "tool_required_stream",
    lambda: [
        c.model_dump()
        for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice="required", max_tokens=400, stream=True, seed=3, temperature=0.7,
        )
    ],
)
record(
    "json_schema",
    lambda: [
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Describe a person"}], max_tokens=400, seed=s,
            temperature=1.0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        ).model_dump()
        for s in (1, 2)
    ],
)
record(
    "json_object",
    lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Reply in JSON"}], max_tokens=400,
        response_format={"type": "json_object"}, temperature=0,
    ).model_dump(),
)
record(
    "n2_logprobs",
    lambda: client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=5, n=2, temperature=1.0, seed=11, logprobs=True, top_logprobs=2
    ).model_dump(),
)
record(
    "thinking",
    lambda: client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, extra_body={"chat_template_kwargs": {"thinking": True}}, temperature=0
    ).model_dump(),
)
record("models", lambda: client.models.list().model_dump())
record("bad_type", lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens="many"))
record("bad_model", lambda: client.chat.completions.create(model="gpt-4", messages=USER, max_tokens=4))
record(
    "bad_tool_choice",
    lambda: client.chat.completions.create(
        model="tiny", messages=USER, tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "nope"}}
    ),
)
wrong = openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0, timeout=60)
record("bad_key", lambda: wrong.chat.completions.create(model="tiny", messages=USER, max_tokens=4))
print(json.dumps(out))
