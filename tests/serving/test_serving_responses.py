"""The Responses API (/v1/responses) through the official `openai` client: plain, streamed, function tools,
previous_response_id continuations, the store (GET, DELETE, input_items pages, LRU bounds, its limits and
the disabled store) and refused features; one server on the default model for the module (and one with
the store disabled)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
import openai
import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
STREAM_TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_plain_equals_chat_completion(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    text, usage = _chat_text(client, [{"role": "user", "content": QUESTION}], 16)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text and text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    finish = (
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
        )
        .choices[0]
        .finish_reason
    )
    assert r.status == r.output[0].status == {"stop": "completed", "length": "incomplete"}[finish]
    with_instructions = client.responses.create(
        model=MODEL,
        instructions="Answer in French.",
        input=[{"role": "user", "content": QUESTION}],
        max_output_tokens=12,
        temperature=0,
    )
    text, _ = _chat_text(
        client, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}], 12
    )
    assert with_instructions.output_text == text


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(
        model=MODEL, input="Count from one to fifty in words.", max_output_tokens=4, temperature=0
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete"


def test_stream_events_and_text_equal_non_stream(client):
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    collapsed = [k for i, k in enumerate(kinds[:-1]) if i == 0 or k != kinds[i - 1]]
    assert collapsed == STREAM_TEXT_EVENTS and kinds[-1] == f"response.{plain.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == plain.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == plain.output_text


def test_function_tool_call_stream_and_result(client):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.responses.create(
        model=MODEL, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=48, temperature=0
    )
    call = r.output[0]
    assert r.status == "completed" and call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema_rs.validate(WEATHER["parameters"], json.loads(call.arguments))
    events = list(
        client.responses.create(
            model=MODEL,
            input=ask,
            tools=[WEATHER],
            max_output_tokens=48,
            temperature=0,
            stream=True,
            tool_choice={"type": "function", "name": "get_weather"},
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    streamed = events[-1].response.output[0]
    assert streamed.type == "function_call" and streamed.arguments == events[4].arguments == call.arguments
    # the tool's answer goes back as a function_call_output item continuing the stored response
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}],
        max_output_tokens=24,
        temperature=0,
    )
    assert follow.previous_response_id == r.id and follow.output[0].type == "message" and follow.output_text
    # its input items: the stored conversation (the call keeps its output item's id), then the tool's answer
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[0].role == "user" and items[0].content[0].text == ask[0]["content"]
    assert items[1].id == call.id and (items[1].call_id, items[1].arguments) == (call.call_id, call.arguments)
    assert items[2].id.startswith("fco_") and items[2].call_id == call.call_id and items[2].status == "completed"
    # the same conversation sent whole gives the same answer
    whole = client.responses.create(
        model=MODEL,
        input=[
            *ask,
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'},
        ],
        max_output_tokens=24,
        temperature=0,
        store=False,
    )
    assert whole.output_text == follow.output_text


def test_previous_response_id_continues_from_the_cached_prefix(client):
    first = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="My name is Alice. Remember it.",
        max_output_tokens=12,
        temperature=0,
    )
    second = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=12,
        temperature=0,
    )
    # the continued prompt starts with the first prompt's tokens: all of them come from the radix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My name is Alice. Remember it."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    text, usage = _chat_text(client, messages, 12)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    third = client.responses.create(
        model=MODEL, previous_response_id=second.id, input="And again?", max_output_tokens=4, temperature=0
    )
    assert third.usage.input_tokens > second.usage.input_tokens


def test_continued_prompt_extends_the_earlier_prompt_tokens(default_engine):
    """The rendering guarantee the cache-aware router relies on, checked on the token ids themselves."""
    from serving.backend import EngineBackend
    from serving.chat_bridge import prepare_chat
    from serving.lifetime import Lifetimes
    from serving.metrics import Metrics
    from serving.responses import chat_request
    from serving.responses_protocol import ResponsesRequest
    from serving.state import ServingState

    st = ServingState(EngineBackend(default_engine), MODEL, Metrics(MODEL), Lifetimes(None))
    turn1 = [{"role": "user", "content": "Plan a trip to Rome."}]
    output = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Day one: the Colosseum."}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    turn2 = [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    for tools in (None, [WEATHER]):
        body = ResponsesRequest(model=MODEL, input=turn1, instructions="Be helpful.", tools=tools)
        ids1 = asyncio.run(prepare_chat(st, chat_request(body, turn1)))[0].prompt_ids
        ids2 = asyncio.run(prepare_chat(st, chat_request(body, turn1 + output + turn2)))[0].prompt_ids
        assert len(ids2) > len(ids1) and ids2[: len(ids1)] == ids1


def test_store_get_delete_and_not_stored(client):
    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="Again.", max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
        ({"truncation": "auto"}, "truncation"),
        ({"model": "no-such-model"}, "model"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ],
)
def test_refused_features_name_their_param(client, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
        client.responses.create(**body)
    assert err.value.body["param"] == param, err.value.body


def test_stream_closed_early_frees_everything(client, default_engine):
    stream = client.responses.create(
        model=MODEL, input="Count from one to a hundred.", max_output_tokens=200, temperature=0, stream=True
    )
    seen = [e.type for _, e in zip(range(6), stream)]
    stream.close()
    assert "response.output_text.delta" in seen
    wait_idle(default_engine)
    assert_no_leak(default_engine)


def test_lru_store_bounds():
    from serving.response_store import LruResponses, StoreLimits

    lru = LruResponses(StoreLimits(max_entries=3, max_bytes=10**6))
    for i in range(3):
        lru.put(f"r{i}", {"response": {"output": []}, "items": [i]})
    assert lru.get("r0") is not None  # r0 is now the most recently used
    lru.put("r3", {"response": {"output": []}, "items": []})
    assert lru.ids() == ["r2", "r0", "r3"] and lru.get("r1") is None
    small = LruResponses(StoreLimits(max_entries=100, max_bytes=200))
    small.put("a", {"items": ["x" * 90]})
    small.put("b", {"items": ["y" * 90]})
    assert small.ids() == ["b"]  # two would exceed 200 bytes: the older one went
    small.put("huge", {"items": ["z" * 500]})
    assert small.get("huge") is None and small.ids() == ["b"]
    assert small.delete("b") and not small.delete("b") and len(small) == 0


def _item_ids(client, rid, **query):
    return [i.id for i in client.responses.input_items.list(rid, **query)]  # iterating follows `after`


def test_input_items_pages(client, base_url):
    from openai.types.responses import ResponseItemList

    turns = [{"role": "developer", "content": "Be brief."}] + [
        {"role": "user", "content": f"Message {i}."} for i in range(4)
    ]
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=2, temperature=0)
    url = f"{base_url}/v1/responses/{r.id}/input_items"
    with httpx.Client(timeout=60) as http:
        page = http.get(url, params={"order": "asc"}).json()
        ResponseItemList.model_validate(page)  # OpenAI's own type (strict: every required field present)
        asc = [i["id"] for i in page["data"]]
        assert len(set(asc)) == 5 and page["has_more"] is False
        assert (page["first_id"], page["last_id"]) == (asc[0], asc[-1])
        first = page["data"][0]
        assert (first["type"], first["role"], first["status"]) == ("message", "developer", "completed")
        assert first["id"].startswith("msg_") and first["content"] == [{"type": "input_text", "text": "Be brief."}]
        assert _item_ids(client, r.id) == asc[::-1]  # default order: desc
        assert _item_ids(client, r.id, limit=2, order="asc") == asc
        assert _item_ids(client, r.id, limit=2) == asc[::-1]
        two = client.responses.input_items.list(r.id, limit=2, order="asc")
        assert [i.id for i in two.data] == asc[:2] and two.has_more is True
        before = http.get(url, params={"order": "asc", "limit": 2, "before": asc[3]}).json()
        assert [i["id"] for i in before["data"]] == asc[1:3] and before["has_more"] is True
        between = http.get(url, params={"order": "asc", "after": asc[0], "before": asc[4]}).json()
        assert [i["id"] for i in between["data"]] == asc[1:4] and between["has_more"] is False
        empty = http.get(url, params={"after": asc[0]}).json()  # desc: nothing after the oldest item
        assert empty["data"] == [] and empty["first_id"] is None and empty["has_more"] is False
        ok = client.responses.input_items.list(r.id, include=["reasoning.encrypted_content"])  # nothing to add
        assert [i.id for i in ok.data] == asc[::-1]
        for query, param in [
            ({"limit": 0}, "limit"),
            ({"limit": 101}, "limit"),
            ({"limit": "x"}, "limit"),
            ({"order": "up"}, "order"),
            ({"after": "msg_nope"}, "after"),
            ({"before": "msg_nope"}, "before"),
            ({"include[]": "message.output_text.logprobs"}, "include"),
            ({"include": "no.such.field"}, "include"),
        ]:
            bad = http.get(url, params=query)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (query, bad.text)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.input_items.list("resp_unknown")
    assert err.value.body["param"] == "response_id" and err.value.body["code"] == "not_found"


def test_item_resources_keep_text_and_make_ids_unique():
    from serving.response_items import item_resources

    items = [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "yo"}], "id": "msg_a"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "msg_a"},
        {"type": "function_call_output", "call_id": "c", "output": "ok"},
    ]
    out = item_resources(items)
    assert out[0]["content"] == [{"type": "input_text", "text": "hi"}] and out[0]["type"] == "message"
    assert out[1]["content"] == [{"type": "output_text", "text": "yo", "annotations": []}] and out[1]["id"] == "msg_a"
    assert out[2]["id"].startswith("fc_") and out[3]["id"].startswith("fco_")  # a repeated id is replaced
    assert item_resources(out) == out and items[0] == {"role": "user", "content": "hi"}  # idempotent, no mutation


def test_store_limits_are_validated():
    from serving.response_store import LruResponses, StoreLimits

    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="max_entries must be an integer >= 0"):
            StoreLimits(max_entries=bad)
    with pytest.raises(ValueError, match="max_bytes"):
        StoreLimits(max_bytes=-5)
    assert StoreLimits().enabled and not StoreLimits(0).enabled and not StoreLimits(8, 0).enabled
    off = LruResponses(StoreLimits(0))
    off.put("r", {"items": []})
    assert off.get("r") is None and len(off) == 0


@pytest.fixture(scope="module")
def no_store_client(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend
    from serving.response_store import LocalResponseStore, StoreLimits

    app = build_app(EngineBackend(default_engine), model_name=MODEL, response_store=LocalResponseStore(StoreLimits(0)))
    with serve(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_disabled_store_answers_store_false_and_404s(no_store_client):
    client = no_store_client
    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2, temperature=0)
    assert r.store is False and r.output_text is not None
    for lookup in (client.responses.retrieve, client.responses.input_items.list, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as err:
            lookup(r.id)
        assert "disabled" in err.value.body["message"] and err.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="Again.", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and "disabled" in err.value.body["message"]


def test_cli_store_flags(monkeypatch):
    import engine
    from serving import server
    from serving.__main__ import main

    class _NoEngine:
        tokenizer, context_len = None, 0

        def __init__(self, *args, **kwargs):
            pass

        def shutdown(self):
            pass

    apps = []
    monkeypatch.setattr(engine, "Engine", _NoEngine)
    monkeypatch.setattr(server, "run", lambda app, **kwargs: apps.append(app))
    main(["--response-store-max-entries", "3", "--response-store-max-bytes", "4096"])
    main(["--response-store-max-entries", "0"])
    assert [a.state.response_store.lru.max_entries for a in apps] == [3, 0]
    assert apps[0].state.response_store.lru.max_bytes == 4096
    assert apps[0].state.response_store.enabled and not apps[1].state.response_store.enabled
    for bad in (["--response-store-max-entries", "-1"], ["--response-store-max-bytes", "lots"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)  # refused before any model loads
        assert exc.value.code == 2
