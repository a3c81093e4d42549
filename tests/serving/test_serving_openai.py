"""The OpenAI-compatible server through the official `openai` client (sync and async, streamed and
not), on the default model served by uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import openai
import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_greedy_matches_engine(client, default_engine):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = default_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12})
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.object == "text_completion" and r.model == MODEL
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (ref.prompt_tokens, ref.completion_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # The same prompt again is served from the radix cache.
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_prompt_forms(client, default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert by_ids == by_text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text
    id_batch = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
    assert id_batch.choices[0].text == by_text and len(id_batch.choices) == 2
    assert batch.usage.prompt_tokens == len(ids) + len(default_engine.tokenizer.encode("1, 2, 3,"))


def test_completion_sampling_parameters(client):
    kw = dict(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0).choices[0].text == ""


def test_n_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0, n=3, seed=1234)
    first = [c.text for c in client.completions.create(**kw).choices]
    second = [c.text for c in client.completions.create(**kw).choices]
    assert first == second and len(first) == 3
    assert len(set(first)) > 1


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3 and value <= 0
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is the best
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + r.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, default_engine):
    """echo + logprobs (what lm-eval-harness sends for log-likelihoods): the prompt tokens' logprobs,
    null for the first, then the completion's, streamed or not."""
    ids = default_engine.tokenizer.encode(PROMPT)
    ref = default_engine.generate(ids, dict(max_new_tokens=1, prompt_logprobs=2, temperature=0))
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([x.logprob for x in ref.prompt_logprobs], abs=1e-5)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[: len(ids)] == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    tokens = sum((c.choices[0].logprobs.tokens for c in streamed if c.choices and c.choices[0].logprobs), [])
    assert tokens == lp.tokens


def test_chat_basic_and_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert r.object == "chat.completion" and r.usage.prompt_tokens > 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_chat_messages_parameters(client):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "One word."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    kw = dict(
        model=MODEL,
        messages=messages,
        max_completion_tokens=8,
        temperature=0.8,
        n=3,
        seed=5,
        stop=["\n"],
        presence_penalty=0.1,
        frequency_penalty=0.1,
        user="u1",
        extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.05, "skip_special_tokens": True},
    )
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert all("\n" not in c.message.content for c in a.choices)
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(
        len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5) for e in content
    )
    ignore = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ignore.usage.completion_tokens == 24 and ignore.choices[0].finish_reason == "length"


def test_chat_tool_messages(client):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _assert_valid_call(call, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    assert call.function.name in schemas
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    assert set(schemas[call.function.name].get("required", [])) <= set(args)
    jsonschema_rs.validate(schemas[call.function.name], args)


def test_tool_choice_required(client):
    tools = [WEATHER, TIME]
    r = client.chat.completions.create(
        model=MODEL,
        tools=tools,
        tool_choice="required",
        max_tokens=48,
        temperature=0,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _assert_valid_call(call, tools)


def test_tool_choice_named_stream(client):
    stream = client.chat.completions.create(
        model=MODEL,
        tools=[WEATHER, TIME],
        max_tokens=48,
        temperature=0,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
    )
    name, args, finish = None, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name == "get_time"
    jsonschema_rs.validate(TIME["function"]["parameters"], json.loads(args))


def test_tool_choice_auto_and_none(client):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    auto = client.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=48, temperature=0, messages=msgs)
    c = auto.choices[0]
    if c.message.tool_calls:  # what the model chooses is its business; the shape is ours
        assert c.finish_reason == "tool_calls"
        assert c.message.tool_calls[0].function.name == "get_weather"
    else:
        assert c.message.content
    none = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0, messages=msgs
    )
    assert none.choices[0].message.tool_calls is None


def test_response_format(client):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    jsonschema_rs.validate(schema, json.loads(r.choices[0].message.content))
    ask = [{"role": "user", "content": 'Reply in JSON, like {"capital": "..."}: what is the capital of France?'}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=48, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, response_format={"type": "text"}
    )
    assert r.choices[0].message.content


def test_response_format_50_sampled_generations_validate(client):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "population", "sights"],
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
            "sights": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
        },
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    ask = [{"role": "user", "content": "Describe a city you like as JSON."}]

    def sample(seed: int) -> list:
        r = client.chat.completions.create(
            model=MODEL, messages=ask, n=10, seed=seed, temperature=1.0, max_tokens=120, response_format=fmt
        )
        assert all(c.finish_reason == "stop" for c in r.choices), [c.message.content for c in r.choices]
        return [c.message.content for c in r.choices]

    with ThreadPoolExecutor(5) as pool:  # five requests at once: the engine batches all 50 choices
        contents = [text for texts in pool.map(sample, range(5)) for text in texts]
    assert len(contents) == 50
    for text in contents:
        jsonschema_rs.validate(schema, json.loads(text))


def test_regex_and_ebnf_extras(client):
    r = client.completions.create(
        model=MODEL, prompt="The year is", max_tokens=8, temperature=0, extra_body={"regex": "[0-9]{4}"}
    )
    assert r.choices[0].text.strip().isdigit() and len(r.choices[0].text.strip()) == 4
    r = client.completions.create(
        model=MODEL,
        prompt="Answer yes or no:",
        max_tokens=8,
        temperature=0,
        extra_body={"ebnf": 'root ::= "yes" | "no"'},
    )
    assert r.choices[0].text in ("yes", "no")


def test_async_client(base_url, default_engine):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        coros = [aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0) for _ in range(3)]
        chat = aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True)
        results = await asyncio.gather(*coros)
        text = ""
        async for chunk in await chat:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        await aclient.close()
        return results, text

    results, text = asyncio.run(run())
    ref = default_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8}).text
    assert all(r.choices[0].text == ref for r in results)
    assert text
    assert wait_idle(default_engine).running == 0


def test_tool_choice_auto_stream_matches_non_stream(client):
    kw = dict(
        model=MODEL,
        tools=[WEATHER, TIME],
        max_tokens=48,
        temperature=0,
        messages=[{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
    )
    full = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            entry["name"] = tc.function.name or entry["name"]
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == full.finish_reason
    if full.message.tool_calls:
        assert [c["name"] for c in calls.values()] == [c.function.name for c in full.message.tool_calls]
        assert [json.loads(c["arguments"]) for c in calls.values()] == [
            json.loads(c.function.arguments) for c in full.message.tool_calls
        ]
    else:
        assert content == full.message.content and not calls


def test_completion_stream_many_prompts(client):
    prompts = [PROMPT, "1, 2, 3,", "Hello"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in full.choices}
