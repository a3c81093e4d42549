"""mode=disaggregated on CPU: 1 prefill + 1 decode replica of the default model, KV handed over
through NIXL over host memory (UCX). The cluster is shared with test_disaggregated_admin.py, which runs
next (disagg_harness.py): requests carry its API key, /router/stats its admin key.

Checked: greedy outputs (batch and streaming) token-identical to unified mode (a local Engine),
both replicas pinned per request, and failures — client aborts at several points of a request
(before, during and after the handoff), the prefill replica killed mid-request — end every request
within a bound, leave no page in use on the survivors, and later requests succeed. A decode replica
killed mid-stream is test_disaggregated_admin.py's (with two of them, the streams go on).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("nixl_cu13._api")

from cluster_harness import abort_storm, wait_for as _wait  # noqa: E402
from disagg_harness import APP, MODEL, PAGE, USER  # noqa: E402
from disagg_harness import all_idle_and_clean as _all_idle_and_clean, pools as _pools  # noqa: E402
from engine_harness import PROMPTS, make_engine  # noqa: E402

LONG_PROMPT = " ".join(f"item {i} is filed under section {i % 7}." for i in range(90))  # ~900 tokens


@pytest.fixture(scope="module")
def cluster(disagg_cluster):
    return disagg_cluster


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster, timeout=180, headers=USER) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    engine = make_engine(page_size=PAGE)
    yield engine
    engine.shutdown()


def _completion(http, prompt: str, max_tokens: int = 16, **extra) -> dict:
    r = http.post(
        "/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, **extra)
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_outputs_identical_to_unified(http, reference):
    want = [o.text for o in reference.generate(PROMPTS, dict(max_new_tokens=16, temperature=0.0))]

    async def all_at_once():
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=180, headers=USER) as client:
            rs = await asyncio.gather(
                *(
                    client.post("/v1/completions", json=dict(model=MODEL, prompt=p, max_tokens=16, temperature=0.0))
                    for p in PROMPTS
                )
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(all_at_once()) == want
    pools = _pools(http)
    assert sum(w["routed_requests"] for w in pools["prefill"].values()) >= len(PROMPTS)
    assert sum(w["routed_requests"] for w in pools["decode"].values()) >= len(PROMPTS)


def test_streaming_identical_and_usage(http, reference):
    want = reference.generate(PROMPTS[6], dict(max_new_tokens=24, temperature=0.0))
    text, usage = "", None
    with http.stream(
        "POST",
        "/v1/completions",
        json=dict(
            model=MODEL,
            prompt=PROMPTS[6],
            max_tokens=24,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        ),
    ) as r:
        assert r.status_code == 200
        import json

        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert text == want.text
    assert usage["completion_tokens"] == 24


def test_prefix_reuse_on_both_pools(http):
    system = "You are a meticulous librarian who answers in one short sentence. " * 8
    _completion(http, system + "Where are the maps?", 4)
    out = _completion(http, system + "Where are the atlases?", 4)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefill replica's radix cache
    _wait(lambda: _all_idle_and_clean(http), 30, "idle after reuse")
    decode = next(iter(_pools(http)["decode"].values()))["engine"]
    assert decode["cached_tokens"] > 0  # the decode replica matched its own cache: fewer pages moved
    assert decode["handoff_requests"] >= 2 and decode["handoff_call_out_s"] > 0 and decode["handoff_call_back_s"] > 0
    # the first token came with the KV's completion notice (not with the call's return)
    assert decode["handoff_notified"] >= 1 and decode["handoff_ready_s"] > 0
    assert decode["first_output_requests"] >= 2  # the Worker's counters stay beside the handoff ones
    # the ingress started both prompts on the prefill replica; the decode replica's calls claimed them
    prefill = next(iter(_pools(http)["prefill"].values()))["engine"]
    assert prefill["early_prefill_started"] >= 2 and prefill["early_prefill_claimed"] >= 2
    assert prefill["early_prefill_held"] == 0


def test_abort_storm_leaks_nothing(cluster, http):
    """Requests closed by their client at random stages (before routing answers, during the prefill on
    the prefill replica or the KV handoff, mid-stream on the decode replica) leave nothing behind: no
    request in flight at the router, no page held outside the prefix caches, no handoff pending."""
    counts = asyncio.run(abort_storm(cluster, MODEL, total=28, concurrency=8, seed=1, headers=USER))
    assert counts.get("aborted", 0) >= 5 and counts.get("completed", 0) >= 5 and not counts.get("error"), counts
    _wait(lambda: _all_idle_and_clean(http), 60, f"no leak after the abort storm {counts}")
    assert _completion(http, PROMPTS[0], 4)["usage"]["completion_tokens"] == 4


def _kill_during(http, deployment_name: str, delay_s: float):
    """Start a long request, kill the pool's replica after delay_s; returns (replica id, response or
    exception, seconds from the kill to the end of the request)."""
    (replica,) = _pools(http)[deployment_name.lower()]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{deployment_name}#{replica}", namespace="serve")

    async def run():
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=150, headers=USER) as client:
            body = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=48, temperature=0.0)
            task = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await asyncio.sleep(delay_s)
            ray.kill(actor, no_restart=True)
            start = time.time()
            try:
                return await asyncio.wait_for(task, 150), time.time() - start
            except Exception as exc:  # noqa: BLE001 - the outcome is checked by the caller
                return exc, time.time() - start

    outcome, elapsed = asyncio.run(run())
    return replica, outcome, elapsed


def _wait_replaced(http, pool: str, dead: str) -> None:
    _wait(
        lambda: dead not in _pools(http).get(pool, {}) and len(_pools(http).get(pool, {})) == 1,
        120,
        f"{pool} replica {dead} replaced",
    )


def test_prefill_replica_killed_mid_request(http):
    """The prefill dies while computing a long prompt: nothing was streamed, so the request is retried
    on the replacement replica (or fails with an error) — never hangs; the decode replica (the receiver) leaks
    nothing."""
    dead, outcome, elapsed = _kill_during(http, "Prefill", 0.3)
    assert elapsed < 150
    if isinstance(outcome, httpx.Response):
        assert outcome.status_code in (200, 500, 503), outcome.text
        if outcome.status_code == 200:
            assert outcome.json()["usage"]["completion_tokens"] == 48
    _wait_replaced(http, "prefill", dead)
    _wait(lambda: _all_idle_and_clean(http), 60, "no leak after the prefill replica died")
    assert _completion(http, PROMPTS[1], 4)["usage"]["completion_tokens"] == 4
