"""mode=disaggregated with each replica's engine core in a process of its own (core_process=true): 1 prefill +
1 decode replica of the default model, KV handed over through NIXL over host memory, each worker's backend
registered over its core's pool as mapped into the worker's process (EngineConfig.share_kv_pool). Deployed on
the Ray and Serve of the disaggregated modules before it (cluster_harness.SHARED_SERVE).

Checked: the workers' cores are processes of their own; greedy outputs, batch and streamed, token-identical to
a local engine, a prefix cached on both sides included; afterwards every KV page of both replicas free or held
by its radix cache.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("nixl_cu13._api")

from cluster_harness import SHARED_SERVE, wait_for  # noqa: E402
from disagg_harness import MODEL, PAGE, USER, all_idle_and_clean, completions_at_once, pools  # noqa: E402
from disagg_harness import args as disagg_args  # noqa: E402
from engine_harness import PROMPTS, make_engine  # noqa: E402

APP = "radixserve-pd-core-process"
TOKENS = 12
CASES = [PROMPTS[0], PROMPTS[2], PROMPTS[0] + " Paris, and the capital of Italy is"]
"""The third extends the first: a radix-cache hit on both pools."""


def _args():
    return disagg_args(core_process=True, max_total_tokens=2048)


@pytest.fixture(scope="module")
def reference():
    engine = make_engine(page_size=PAGE)
    try:
        yield [o.text for o in engine.generate(CASES, dict(max_new_tokens=TOKENS, temperature=0.0))]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def http(reference):
    url = SHARED_SERVE.deploy(APP, _args)
    with httpx.Client(base_url=url, timeout=180, headers=USER) as client:
        yield client


def _completion(http, prompt: str, stream: bool = False) -> str:
    body = dict(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0.0, stream=stream)
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_each_worker_core_runs_in_a_process_of_its_own(http):
    import psutil

    for pool, name in (("prefill", "Prefill"), ("decode", "Decode")):
        (wid,) = pools(http)[pool]
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{name}#{wid}", namespace="serve")
        worker = psutil.Process(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())))
        cores = [p for p in worker.children() if "engine.core.process" in " ".join(p.cmdline())]
        assert len(cores) == 1, [p.cmdline() for p in worker.children()]


def test_greedy_outputs_identical_to_a_local_engine_and_every_page_comes_back(http, reference):
    assert completions_at_once(str(http.base_url), CASES[:2], TOKENS) == reference[:2]
    assert _completion(http, CASES[2], stream=True) == reference[2]  # its prefix is cached on both sides
    assert _completion(http, CASES[1]) == reference[1]
    wait_for(lambda: all_idle_and_clean(http), 60, "every KV page free or cached on both replicas")
