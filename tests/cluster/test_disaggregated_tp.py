"""mode=disaggregated with tensor parallelism on CPU (gloo): 1 prefill + 1 decode replica of the default model,
each over 2 ranks, KV handed over rank to rank through NIXL over host memory (cluster.kv_transfer.ranked).
Deployed on the Ray and Serve of the disaggregated modules before it (cluster_harness.SHARED_SERVE).

Checked: greedy outputs token-identical to a unified TP=2 engine and to TP=1, and afterwards every KV page
of both replicas free or held by its radix cache; then the death of the decode replica's rank 1 ends that
replica cleanly (the router drops it, a request gets a 503 or the replacement's answer, never a hang, its
processes exit) and its replacement serves the same greedy text. Serve checks the replicas' health every
0.5 s here, so the dead one is replaced soon.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("nixl_cu13._api")

from cluster_harness import SHARED_SERVE, wait_for  # noqa: E402
from disagg_harness import MODEL, PAGE, USER, all_idle_and_clean, completions_at_once, pools  # noqa: E402
from disagg_harness import args as disagg_args  # noqa: E402
from engine_harness import PROMPTS, make_engine  # noqa: E402

APP = "radixserve-pd-tp2"
TOKENS = 8
CASES = [PROMPTS[0], PROMPTS[1], PROMPTS[0] + " Paris, and the capital of Italy is"]
"""The third extends the first: a radix-cache hit on both pools."""


def _args():
    return disagg_args(
        tensor_parallel_size=2, max_total_tokens=2048, kv_transfer_timeout_s=30, health_check_period_s=0.5
    )


@pytest.fixture(scope="module")
def references():
    """Greedy texts of CASES from a unified TP=2 engine and a TP=1 engine (in this process, one at a time)."""
    texts = []
    for tp in (2, 1):
        engine = make_engine(page_size=PAGE, tensor_parallel_size=tp)
        try:
            texts.append([o.text for o in engine.generate(CASES, dict(max_new_tokens=TOKENS, temperature=0.0))])
        finally:
            engine.shutdown()
    return texts


@pytest.fixture(scope="module")
def cluster(references):
    return SHARED_SERVE.deploy(APP, _args)


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster, timeout=180, headers=USER) as client:
        yield client


def test_tp2_handoff_matches_unified_tp2_and_tp1_and_frees_every_page(http, references):
    tp2, tp1 = references
    assert tp2 == tp1

    base = str(http.base_url)
    assert completions_at_once(base, CASES[:2], TOKENS) == tp2[:2]
    # After the first: its prefix is cached on both sides.
    assert completions_at_once(base, CASES[2:], TOKENS) == tp2[2:]
    by_pool = pools(http)
    assert {w["engine"]["tensor_parallel_size"] for ws in by_pool.values() for w in ws.values()} == {2.0}
    wait_for(lambda: all_idle_and_clean(http), 60, "every KV page free or cached on both replicas")


def test_a_dead_follower_rank_ends_its_replica_and_the_replacement_serves(http, references):
    import psutil

    tp2 = references[0]
    (decode_id,) = pools(http)["decode"]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Decode#{decode_id}", namespace="serve")
    rank0 = psutil.Process(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())))
    ranks = [p for p in rank0.children(recursive=True) if "engine.runner.follower" in " ".join(p.cmdline())]
    assert len(ranks) == 1, [p.cmdline() for p in rank0.children(recursive=True)]
    ranks[0].kill()

    def completion(prompt: str) -> httpx.Response:
        return http.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0.0))

    # Rank 0 sees the death within a second: the engine ends and the router drops the replica. A request then
    # gets a clear 503 (no decode replica) or, once Serve's replacement has joined, its answer: the router waits
    # up to 60 s for a decode replica before its 503, so a request that takes longer hung on the dead one.
    wait_for(lambda: decode_id not in pools(http).get("decode", {}), 60, "the router to drop the decode replica")
    start = time.monotonic()
    r = completion(CASES[0])
    assert time.monotonic() - start < 90, "a request hung on the dead replica"
    if r.status_code == 503:
        assert r.headers.get("retry-after") and r.json()["error"]["code"] == "no_workers", r.text
        r = wait_for(lambda: (a := completion(CASES[0])).status_code == 200 and a, 300, "the new pair to serve")
    # a 200 comes from the replacement: the router keeps the dropped replica out
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == tp2[0], r.text
    assert set(pools(http)["decode"]) - {decode_id}, "a replacement decode replica"
    # Serve replaced the replica (its health check fails): rank 0 and every rank process of it are gone.
    wait_for(lambda: not rank0.is_running() or rank0.status() == psutil.STATUS_ZOMBIE, 180, "the dead replica to exit")
