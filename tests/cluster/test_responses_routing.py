"""previous_response_id in the cluster: a continued conversation renders as the earlier one did with the new
items after it, so its prompt starts with the earlier prompt's token ids and the cache-aware router sends it
to the worker holding that prefix. No Ray: the router's policy over the real rendering of both turns (the
live cluster runs both APIs in test_cluster.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.router.policies import PoolRouter
from serving.chat import plan_chat
from serving.responses import chat_request
from serving.responses_protocol import ResponsesRequest

STORY = " ".join(f"Fact {i}: the {w} is on the table." for i, w in enumerate("red blue green cup book pen".split()))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def rendering():
    """What plan_chat uses of the serving state: the default model's tokenizer, and its encoder."""
    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer
    from serving.encoder import BatchEncoder

    tokenizer = load_tokenizer(resolve_model(None))
    return SimpleNamespace(tokenizer=tokenizer, encode=BatchEncoder(tokenizer).encode)


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_continuation_goes_to_the_worker_holding_its_prefix(rendering, tools):
    turn1 = [{"role": "user", "content": STORY + " Remember these facts."}]
    body = ResponsesRequest(model="m", input=turn1, instructions="Be brief.", tools=tools)
    ids1 = asyncio.run(plan_chat(rendering, chat_request(body, turn1))).prompt_ids
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Noted."}]}]
    turn2 = [*turn1, *output, {"role": "user", "content": "Where is the pen?"}]
    ids2 = asyncio.run(plan_chat(rendering, chat_request(body, turn2))).prompt_ids
    assert len(ids2) > len(ids1) and ids2[: len(ids1)] == ids1

    router = PoolRouter("cache_aware")
    router.state.sync_members(["w0", "w1", "w2"])
    first = router.route(ids1)
    router.finish(first.worker_id)
    second = router.route(ids2)
    # a miss would go to an empty worker (least loaded, then smallest tree): the hit is the prefix's doing
    assert (second.worker_id, second.reason) == (first.worker_id, "cache_hit")
    assert second.matched_tokens >= len(ids1)
