"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic`
client: plain, streamed, tool use and tool results, stop sequences, Anthropic-shaped errors and the
x-api-key header; servers on the default model for the module."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema_rs
import openai
import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

QUESTION = "What is the capital of France?"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
KEY = "test-key-123"
GREEDY = {"extra_body": {"temperature": 0}}
"""The SDK's typed arguments no longer list temperature / top_p / top_k; the API still takes them."""


@pytest.fixture(scope="module")
def client(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(chat, messages, max_tokens, **kw):
    return chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_plain_equals_chat_completion(client, chat):
    m = client.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=[{"role": "user", "content": QUESTION}])
    ref = _chat(chat, [{"role": "user", "content": QUESTION}], 16)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text == ref.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.choices[0].finish_reason]
    assert m.usage.output_tokens == ref.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    again = client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": QUESTION}])
    assert again.usage.cache_read_input_tokens > 0  # the same prompt again: served from the radix cache
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    count = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == ref.usage.prompt_tokens


def test_system_string_and_blocks(client, chat):
    msgs = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    a = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, system="Answer in French.", messages=msgs)
    b = client.messages.create(
        model=MODEL,
        max_tokens=12,
        **GREEDY,
        system=[{"type": "text", "text": "Answer in French."}],
        messages=msgs,
    )
    ref = _chat(chat, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}], 12)
    assert a.content[0].text == b.content[0].text == ref.choices[0].message.content


def test_stream_helper_and_raw_events(client):
    kw = dict(model=MODEL, max_tokens=16, **GREEDY, messages=[{"role": "user", "content": QUESTION}])
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2].delta.stop_reason == plain.stop_reason


def test_tool_use_then_tool_result(client, chat):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = client.messages.create(
        model=MODEL, max_tokens=48, **GREEDY, tools=[WEATHER], tool_choice={"type": "any"}, messages=ask
    )
    assert m.stop_reason == "tool_use"
    use = m.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema_rs.validate(WEATHER["input_schema"], use.input)
    with client.messages.stream(
        model=MODEL,
        max_tokens=48,
        **GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask,
    ) as stream:
        raw = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in raw and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == use.input
    turns = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees, sunny"}]},
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=24, **GREEDY, tools=[WEATHER], tool_choice={"type": "none"}, messages=turns
    )
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    # the same turns as OpenAI tool messages render the same prompt and give the same answer
    ref = _chat(
        chat,
        [
            *ask,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "21 degrees, sunny"},
        ],
        24,
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"]}}],
        tool_choice="none",
    )
    assert answer.content[0].text == ref.choices[0].message.content


def test_output_config_json_schema(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    m = client.messages.create(
        model=MODEL,
        max_tokens=40,
        **GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}],
    )
    if m.stop_reason == "end_turn":
        jsonschema_rs.validate(schema, json.loads(m.content[0].text))
    else:
        assert m.content[0].text.startswith("{")


def test_stream_closed_early_frees_everything(client, default_engine):
    with client.messages.stream(
        model=MODEL, max_tokens=200, **GREEDY, messages=[{"role": "user", "content": "Count from one to a hundred."}]
    ) as stream:
        pieces = [text for _, text in zip(range(4), stream.text_stream)]
    assert len(pieces) == 4
    wait_idle(default_engine)
    assert_no_leak(default_engine)


def test_stop_sequences(client):
    kw = dict(model=MODEL, max_tokens=24, **GREEDY, messages=[{"role": "user", "content": QUESTION}])
    full = client.messages.create(**kw).content[0].text
    word = full.split()[2]
    m = client.messages.create(**kw, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == full[: full.index(word)]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "tools[0].type",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            "thinking",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "output_config": {"effort": "high"}},
            "effort",
        ),
    ],
)
def test_errors_are_anthropic_shaped(client, base_url, body, param):
    r = httpx.post(f"{base_url}/v1/messages", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"]
    if "max_tokens" in body:  # the SDK itself requires max_tokens
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model=MODEL, **body)
        assert raised.value.body["error"]["type"] == "invalid_request_error"


def test_unknown_model_and_route(base_url):
    r = httpx.post(
        f"{base_url}/v1/messages",
        json={"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code in (400, 404) and r.json()["type"] == "error" and "claude-x" in r.json()["error"]["message"]
    r = httpx.get(f"{base_url}/v1/messages/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_x_api_key(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    with serve(build_app(EngineBackend(default_engine), model_name=MODEL, api_key=KEY)) as url:
        good = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        m = good.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens == 2
        bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["error"]["type"] == "authentication_error"
        r = httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY})  # other routes take the header too
        assert r.status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
