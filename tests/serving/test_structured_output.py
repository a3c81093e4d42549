"""Structured output and tool calls through HTTP on the default model (one server for the module):
JSONSchemaBench schemas with strict json_schema (no 5xx, refusals name the feature, every output
that stops validates, compact JSON), refused schemas and strict tools, cut forced calls."""

from __future__ import annotations

import glob
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "jsonschemabench")
FEATURE_WORDS = ("keyword", "oneOf", "format", "$ref", "pattern", "minProperties", "maxProperties", "intersection")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


@pytest.fixture(scope="module")
def http(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
        with httpx.Client(base_url=url, timeout=300) as client:
            yield client
    wait_idle(default_engine)
    assert_no_leak(default_engine)


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})


def test_jsonschemabench_strict_json_schema(http):
    """Every schema of tests/data/jsonschemabench, greedy, at most 64 tokens, all at once (one batch)."""
    files = sorted(glob.glob(os.path.join(DATA, "*.json")))

    def one(path):
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)["schema"]
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": "Reply with a small JSON value that matches the schema."}]
        return path, schema, chat(http, messages=messages, max_tokens=64, response_format=fmt)

    with ThreadPoolExecutor(len(files)) as pool:
        results = list(pool.map(one, files))
    counts = {"refused": 0, "stop": 0, "length": 0}
    for path, schema, r in results:
        name = os.path.basename(path)
        assert r.status_code in (200, 400), (name, r.status_code, r.text[:300])
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["param"] == "response_format" and any(w in err["message"] for w in FEATURE_WORDS), (name, err)
            counts["refused"] += 1
            continue
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        assert "\n" not in text and not text[:1].isspace(), (name, text[:200])  # compact JSON
        counts[choice["finish_reason"]] += 1
        if choice["finish_reason"] == "stop":
            value = json.loads(text)
            errors = [e.message for e in jsonschema.validators.validator_for(schema)(schema).iter_errors(value)]
            assert not errors, (name, text[:300], errors[:2])
        else:
            assert choice["finish_reason"] == "length", (name, choice)
    print("jsonschemabench over HTTP:", counts)
    assert counts["refused"] >= 1 and counts["stop"] >= 15, counts


@pytest.mark.parametrize(
    "schema, feature",
    [
        ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}, "oneOf"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}}, "not"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "minProperties"),
        ({"type": "object", "x-guidance": {"lenient": True}}, "lenient"),
    ],
)
def test_refused_schemas_name_the_feature(http, schema, feature):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = chat(http, messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=fmt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and feature in err["message"], err


def test_multiple_of_and_all_of_are_enforced(http):
    schema = {
        "type": "object",
        "allOf": [
            {"properties": {"n": {"type": "integer", "multipleOf": 7}}, "required": ["n"]},
            {"properties": {"n": {"minimum": 10, "maximum": 40}}},
        ],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": 'Pick a number between 10 and 40 and answer as JSON {"n": ...}.'}]
    r = chat(http, messages=msgs, max_tokens=24, n=4, temperature=1.0, seed=3, response_format=fmt)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            n = json.loads(choice["message"]["content"])["n"]
            assert n % 7 == 0 and 10 <= n <= 40, choice


def test_strict_tool_with_unsupported_parameters_is_refused(http):
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["parameters"]["properties"]["city"]["format"] = "no-such-format"
    for choice in ("auto", "required"):
        r = chat(http, messages=ASK_WEATHER, tools=[tool], tool_choice=choice, max_tokens=8)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "format" in r.json()["error"]["message"]


def test_forced_call_cut_by_max_tokens_leaks_nothing(http):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = chat(http, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=choice, max_tokens=6)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "length" and c["message"]["content"] is None, c
        assert not c["message"].get("tool_calls"), c
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "temperature": 0,
            "messages": ASK_WEATHER,
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 6,
            "stream": True,
        },
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert all(not d.get("content") and not d.get("tool_calls") for d in deltas), deltas
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_forced_call_that_finishes_is_a_valid_call(http):
    r = chat(http, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=64)
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    for call in c["message"]["tool_calls"]:
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_strict_tool_under_auto(http):
    """Whatever the model chooses, a call it makes under "auto" matches the strict schema."""
    r = chat(http, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=48, temperature=1.0, seed=1, n=4)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        if c["finish_reason"] == "tool_calls":
            for call in c["message"]["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        elif c["finish_reason"] == "stop":
            text = c["message"]["content"]
            assert text and text[0] not in "{[ \n", text
