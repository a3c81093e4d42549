"""mode=disaggregated with tensor parallelism on CPU (gloo): 1 prefill + 1 decode replica of the default model,
each over 2 ranks, KV handed over rank to rank through NIXL over host memory (cluster.kv_transfer.ranked).
Deployed on the Ray and Serve of the disaggregated modules before it (cluster_harness.SHARED_SERVE).

Checked: greedy outputs token-identical to a unified TP=2 engine and to TP=1, and afterwards every KV page
of both replicas free or held by its radix cache.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("nixl_cu13._api")

from cluster_harness import SHARED_SERVE, wait_for  # noqa: E402
from disagg_harness import MODEL, PAGE, USER, all_idle_and_clean, pools  # noqa: E402
from disagg_harness import args as disagg_args  # noqa: E402
from engine_harness import PROMPTS, make_engine  # noqa: E402

APP = "radixserve-pd-tp2"
TOKENS = 8
CASES = [PROMPTS[0], PROMPTS[1], PROMPTS[0] + " Paris, and the capital of Italy is"]
"""The third extends the first: a radix-cache hit on both pools."""


def _args():
    return disagg_args(tensor_parallel_size=2, max_total_tokens=2048, kv_transfer_timeout_s=30)


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

    async def all_at_once(prompts):
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=180, headers=USER) as client:
            rs = await asyncio.gather(
                *(
                    client.post("/v1/completions", json=dict(model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0.0))
                    for p in prompts
                )
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(all_at_once(CASES[:2])) == tp2[:2]
    assert asyncio.run(all_at_once(CASES[2:])) == tp2[2:]  # after the first: its prefix is cached on both sides
    by_pool = pools(http)
    assert {w["engine"]["tensor_parallel_size"] for ws in by_pool.values() for w in ws.values()} == {2.0}
    wait_for(lambda: all_idle_and_clean(http), 60, "every KV page free or cached on both replicas")
