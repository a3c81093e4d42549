"""Every documented request parameter of chat and completions is honoured or refused.

The walk (`test_every_documented_parameter_is_honoured_or_refused`) reads the parameters from
OpenAI's published schemas (CreateChatCompletionRequest, CreateCompletionRequest) and fails on one
in no table: a parameter the spec adds cannot be ignored silently. HONOURED names, for each
parameter, the test below that shows its effect; NO_OUTPUT_EFFECT holds bookkeeping parameters
that by definition do not change the output (shown unchanged); every other one is refused with a
400 naming it (serving/unsupported.py), which the walk sends."""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any, Dict

import httpx
import pytest

from engine_harness import assert_no_leak
from openai_spec import request_parameters
from serving_harness import MODEL, serve

PROMPT = "The capital of France is"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}

HONOURED: Dict[str, str] = {
    "model": "test_model",
    "messages": "test_prompt_and_messages",
    "prompt": "test_prompt_and_messages",
    "temperature": "test_temperature_and_top_p",
    "top_p": "test_temperature_and_top_p",
    "seed": "test_seed",
    "n": "test_n",
    "stop": "test_stop",
    "max_tokens": "test_max_tokens",
    "max_completion_tokens": "test_max_tokens",
    "presence_penalty": "test_penalties",
    "frequency_penalty": "test_penalties",
    "logit_bias": "test_logit_bias_bans_and_forces_tokens",
    "logprobs": "test_logprobs",
    "top_logprobs": "test_logprobs",
    "echo": "test_echo",
    "best_of": "test_best_of",
    "stream": "test_stream_and_stream_options",
    "stream_options": "test_stream_and_stream_options",
    "response_format": "test_response_format",
    "tools": "test_tools_and_tool_choice",
    "tool_choice": "test_tools_and_tool_choice",
    "parallel_tool_calls": "test_parallel_tool_calls",
}
"""Parameter → the test of this module that shows its documented effect."""

NO_OUTPUT_EFFECT = {"user", "safety_identifier", "metadata", "prompt_cache_key"}
"""End-user ids, metadata for stored objects, a cache-routing hint: accepted; the output is unchanged."""

REFUSED_EXAMPLES: Dict[str, Any] = {
    "functions": [WEATHER["function"]],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "verbosity": "low",
    "reasoning_effort": "low",
    "web_search_options": {},
    "prediction": {"type": "content", "content": "Paris"},
    "service_tier": "flex",
    "store": True,
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {},
    "moderation": {},
    "suffix": " and that is all.",
}
"""A value of each refused parameter that the server does not honour."""

ACCEPTED_DEFAULTS: Dict[str, Any] = {
    "modalities": ["text"],
    "verbosity": "medium",
    "service_tier": "auto",
    "store": False,
    "prompt_cache_retention": "in_memory",
    "suffix": "",
}
"""Values of refused parameters that mean what the server does anyway: accepted."""


def chat(**kw) -> Dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0, **kw}


def cmpl(**kw) -> Dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}


def post(http: httpx.Client, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text(http: httpx.Client, path: str, body: Dict[str, Any], k: int = 0) -> str:
    choice = post(http, path, body)["choices"][k]
    return choice["text"] if path == CMPL else choice["message"]["content"]


def refused(http: httpx.Client, path: str, body: Dict[str, Any], param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, (param, r.text)
    assert r.json()["error"]["param"] == param, r.text


# --- the walk ---------------------------------------------------------------------------------
@pytest.mark.parametrize("schema, path", [("CreateChatCompletionRequest", CHAT), ("CreateCompletionRequest", CMPL)])
def test_every_documented_parameter_is_honoured_or_refused(http, schema, path):
    from serving.unsupported import CHAT_REFUSED, COMPLETION_REFUSED

    table = CHAT_REFUSED if path == CHAT else COMPLETION_REFUSED
    base = chat() if path == CHAT else cmpl()
    documented = request_parameters(schema)
    assert len(documented) > 10
    module = sys.modules[__name__]
    for param in documented:
        kinds = [param in HONOURED, param in NO_OUTPUT_EFFECT, param in table]
        assert sum(kinds) == 1, f"{schema}.{param}: honoured, no-effect or refused? (exactly one)"
        if param in HONOURED:
            test = getattr(module, HONOURED[param], None)
            assert test is not None and param in inspect.getsource(test), f"{param}: {HONOURED[param]} shows no effect"
        elif param in table:
            refused(http, path, {**base, param: REFUSED_EXAMPLES[param]}, param)
            if param in ACCEPTED_DEFAULTS:
                post(http, path, {**base, param: ACCEPTED_DEFAULTS[param]})
    assert set(table) <= set(documented), "a refusal table names a parameter the schema does not document"


# --- effects ----------------------------------------------------------------------------------
def test_model(http):
    assert post(http, CMPL, cmpl())["model"] == MODEL
    assert http.post(CMPL, json=cmpl(model="other")).status_code == 404
    assert http.post(CHAT, json=chat(model="other")).status_code == 404


def test_prompt_and_messages(http, default_engine):
    ref = default_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8}).text
    assert text(http, CMPL, cmpl(prompt=PROMPT)) == ref
    assert text(http, CMPL, cmpl(prompt="1, 2, 3,")) != ref
    first = text(http, CHAT, chat(messages=MSGS))
    assert text(http, CHAT, chat(messages=[{"role": "user", "content": "Count to five."}])) != first


def test_temperature_and_top_p(http, default_engine):
    greedy = default_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16}).text
    assert text(http, CMPL, cmpl(max_tokens=16, temperature=0)) == greedy
    hot = cmpl(max_tokens=16, temperature=2.0, seed=11)
    assert text(http, CMPL, hot) != greedy
    # top_p so small that only the most likely token is left: sampling at any temperature is greedy.
    assert text(http, CMPL, {**hot, "top_p": 1e-6}) == greedy
    assert text(http, CHAT, chat(max_tokens=16, temperature=2.0, seed=11, top_p=1e-6)) == text(
        http, CHAT, chat(max_tokens=16)
    )


def test_seed(http):
    body = cmpl(max_tokens=16, temperature=1.0, seed=1)
    assert text(http, CMPL, body) == text(http, CMPL, body)
    assert text(http, CMPL, body) != text(http, CMPL, {**body, "seed": 2})


def test_n(http):
    r = post(http, CHAT, chat(n=3, temperature=1.0, seed=4))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in r["choices"]}) > 1
    assert len(post(http, CMPL, cmpl(n=2))["choices"]) == 2


def test_stop(http):
    full = text(http, CMPL, cmpl(prompt="1, 2, 3, 4,", max_tokens=16))
    assert " 7" in full
    r = post(http, CMPL, cmpl(prompt="1, 2, 3, 4,", max_tokens=16, stop=[" 7"]))["choices"][0]
    assert r["text"] == full[: full.index(" 7")] and r["finish_reason"] == "stop"
    answer = text(http, CHAT, chat(max_tokens=16))
    word = answer.split()[1]
    r = post(http, CHAT, chat(max_tokens=16, stop=word))["choices"][0]
    assert r["message"]["content"] == answer[: answer.index(word)] and r["finish_reason"] == "stop"


def test_max_tokens(http):
    r = post(http, CMPL, cmpl(max_tokens=3))
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    r = post(http, CHAT, chat(max_tokens=2))
    assert r["usage"]["completion_tokens"] == 2
    r = post(http, CHAT, chat(max_tokens=2, max_completion_tokens=4))  # the newer name wins
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"


def test_penalties(http):
    body = cmpl(prompt="red red red red red red red red", max_tokens=16)
    plain = text(http, CMPL, body)
    assert text(http, CMPL, {**body, "presence_penalty": 2.0}) != plain
    assert text(http, CMPL, {**body, "frequency_penalty": 2.0}) != plain
    repeat = chat(max_tokens=24, messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    assert text(http, CHAT, {**repeat, "frequency_penalty": 2.0}) != text(http, CHAT, repeat)


def test_logit_bias_bans_and_forces_tokens(http, default_engine):
    """-100 bans the token greedy decoding picks; +100 forces a token, on both routes."""
    tok = default_engine.tokenizer
    first = default_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1}).token_ids[0]
    banned = post(http, CMPL, cmpl(max_tokens=1, logprobs=1, logit_bias={str(first): -100}))["choices"][0]
    assert banned["logprobs"]["tokens"][0] != tok.decode([first])
    the = tok.encode(" the")[0]
    forced = text(http, CMPL, cmpl(max_tokens=4, logit_bias={str(the): 100}))
    assert forced == tok.decode([the] * 4)
    assert text(http, CHAT, chat(max_tokens=3, temperature=1.0, seed=9, logit_bias={the: 100})) == tok.decode([the] * 3)
    chat_first = post(http, CHAT, chat(max_tokens=1, logprobs=True))["choices"][0]["logprobs"]["content"][0]["token"]
    chat_ids = tok.encode(chat_first, add_special_tokens=False)
    bias = {str(chat_ids[0]): -100}
    again = post(http, CHAT, chat(max_tokens=1, logprobs=True, logit_bias=bias))["choices"][0]["logprobs"]["content"]
    assert again[0]["token"] != chat_first


def test_logprobs(http):
    r = post(http, CHAT, chat(max_tokens=3, logprobs=True, top_logprobs=2))["choices"][0]["logprobs"]
    assert len(r["content"]) == 3 and all(len(e["top_logprobs"]) == 2 for e in r["content"])
    assert post(http, CHAT, chat(max_tokens=3))["choices"][0]["logprobs"] is None
    c = post(http, CMPL, cmpl(max_tokens=3, logprobs=2))["choices"][0]["logprobs"]
    assert len(c["tokens"]) == 3 and all(len(t) == 2 for t in c["top_logprobs"])


def test_echo(http):
    assert text(http, CMPL, cmpl(echo=True)) == PROMPT + text(http, CMPL, cmpl())


def test_best_of(http):
    assert len(post(http, CMPL, cmpl(n=2, best_of=2))["choices"]) == 2
    refused(http, CMPL, cmpl(n=1, best_of=3), "best_of")


def test_stream_and_stream_options(http):
    body = chat(stream=True, stream_options={"include_usage": True})
    with http.stream("POST", CHAT, json=body) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == text(
        http, CHAT, chat()
    )
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_response_format(http):
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    out = text(http, CHAT, chat(max_tokens=16, response_format=fmt))
    assert json.loads(out) == {"a": "x"}


def test_tools_and_tool_choice(http):
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = post(http, CHAT, chat(messages=ask, max_tokens=32, tools=[WEATHER, TIME], tool_choice=named))
    calls = r["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"] and r["choices"][0]["finish_reason"] == "tool_calls"
    r = post(http, CHAT, chat(messages=ask, max_tokens=8, tools=[WEATHER, TIME], tool_choice="none"))
    assert "tool_calls" not in r["choices"][0]["message"]


def test_parallel_tool_calls(http):
    """false keeps at most one call per choice (true, the default, permits several)."""
    from serving.chat import ChatPlan
    from serving.protocol import Tool

    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    two = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "X"}}]'
    assert len(ChatPlan([], None, "auto", tools).parse_calls(two)) == 2
    one = ChatPlan([], None, "auto", tools, parallel_tool_calls=False).parse_calls(two)
    assert [c.function.name for c in one] == ["get_weather"]
    body = chat(max_tokens=32, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(post(http, CHAT, body)["choices"][0]["message"]["tool_calls"]) == 1


def test_bookkeeping_parameters_leave_the_output_unchanged(http):
    extras = {"user": "u1", "safety_identifier": "s1", "metadata": {"k": "v"}, "prompt_cache_key": "p1"}
    assert set(extras) == NO_OUTPUT_EFFECT
    assert text(http, CHAT, chat(**extras)) == text(http, CHAT, chat())
    assert text(http, CMPL, cmpl(user="u1")) == text(http, CMPL, cmpl())
