"""The cluster with tensor parallelism on GPUs, started as a user starts it (`bash deploy/serve.sh ARGS`,
the README's `serve run cluster.app:deployment`): needs four CUDA devices.

- Two TP=2 replicas behind the cache-aware router, and a disaggregated TP=2 prefill + TP=2 decode pair
  (KV handed over rank to rank), give the greedy completions of one unified TP=2 replica, token for
  token (the default model, bf16). Prompts go one at a time, so every request is computed alone in
  each deployment (the same kernels, the same reductions) and identity is exact, not a tolerance.
- With RADIXSERVE_TP4_MODEL set to a Hugging Face model folder (for example a Llama-3.1-70B config and
  tokenizer, with RADIXSERVE_TP4_LOAD_FORMAT=dummy), one TP=4 replica serves it and answers the README's
  `openai` example.

Each deployment is stopped with SIGTERM, as a user stops it, before the next one starts on port 8000.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Dict, Iterator, List

import httpx
import pytest

from cluster_harness import SERVE_SH_URL, cluster_idle, router_stats, serve_sh, wait_for
from engine_harness import PROMPTS

pytestmark = pytest.mark.gpu

START_TIMEOUT_S = 600.0
"""Ray, Serve and every replica's engine (model load, CUDA graph capture on each rank)."""
TOKENS = 24
CASES = PROMPTS[:6] + [PROMPTS[0] + " Paris, and the capital of Italy is"]
"""The last extends the first: a radix-cache hit where the first was computed."""


@pytest.fixture(autouse=True, scope="module")
def _four_gpus():
    """Module-scoped, so that it runs before the module-scoped cluster fixtures: a machine with fewer GPUs
    skips without starting a cluster."""
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip("needs four CUDA devices")


@contextlib.contextmanager
def served(*args: str, log_name: str) -> Iterator[str]:
    """The cluster of `bash deploy/serve.sh ARGS`, its log in $OUT/<log_name>.log (GPU runs) or the temp dir."""
    log_dir = os.environ.get("OUT") or os.environ.get("TMPDIR", "/tmp")
    with serve_sh(*args, log_path=os.path.join(log_dir, f"{log_name}.log"), timeout=START_TIMEOUT_S):
        yield SERVE_SH_URL


def _completions(url: str) -> List[str]:
    """Greedy completions of CASES, one request at a time; checks the replicas' KV pages afterwards."""
    texts = []
    with httpx.Client(base_url=url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for prompt in CASES:
            r = client.post(
                "/v1/completions",
                json=dict(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
            )
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        wait_for(lambda: cluster_idle(router_stats(client)), 60, "every KV page free or cached")
    return texts


def _workers(client: httpx.Client) -> Dict[str, dict]:
    """worker id -> its /router/stats entry (pool, in_flight, engine stats), over every pool."""
    return router_stats(client)["workers"]


def _tensor_parallel_sizes(url: str, replicas: int) -> List[float]:
    """Each worker replica's tensor-parallel size, once `replicas` of them have reported to the router."""
    with httpx.Client(base_url=url, timeout=30) as client:

        def reported() -> List[dict]:
            workers = [w for w in _workers(client).values() if w["engine"]]
            return workers if len(workers) >= replicas else []

        workers = wait_for(reported, 120, f"{replicas} worker replica(s) to report")
        return sorted(w["engine"]["tensor_parallel_size"] for w in workers)


@pytest.fixture(scope="module")
def unified_tp2() -> List[str]:
    """The reference: greedy completions of CASES from one unified TP=2 replica."""
    with served("tensor_parallel_size=2", log_name="unified-tp2") as url:
        assert _tensor_parallel_sizes(url, 1) == [2.0]
        return _completions(url)


def test_two_tp2_replicas_behind_cache_aware_match_unified_tp2(unified_tp2):
    with served("tensor_parallel_size=2", "workers=2", "policy=cache_aware", log_name="unified-2x-tp2") as url:
        assert _tensor_parallel_sizes(url, 2) == [2.0, 2.0]
        assert _completions(url) == unified_tp2


def test_disaggregated_tp2_prefill_and_decode_match_unified_tp2(unified_tp2):
    with served(
        "tensor_parallel_size=2", "mode=disaggregated", "prefill_workers=1", "decode_workers=1", log_name="pd-tp2"
    ) as url:
        assert _tensor_parallel_sizes(url, 2) == [2.0, 2.0]
        assert _completions(url) == unified_tp2


README_EXAMPLE = """
from openai import OpenAI
import sys
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
messages = [{"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(model=sys.argv[1], messages=messages, temperature=0, max_tokens=32)
print(r.choices[0].message.content)
print(r.usage.completion_tokens)
"""
"""The README's `openai` example, the served model's name passed in."""


def test_tp4_replica_answers_the_readme_openai_example():
    model = os.environ.get("RADIXSERVE_TP4_MODEL")
    if not model:
        pytest.skip("set RADIXSERVE_TP4_MODEL to a model folder (e.g. a Llama-3.1-70B config) to run")
    load_format = os.environ.get("RADIXSERVE_TP4_LOAD_FORMAT", "auto")
    with served(
        f"model={model}", f"load_format={load_format}", "tensor_parallel_size=4", log_name="unified-tp4"
    ) as url:
        assert _tensor_parallel_sizes(url, 1) == [4.0]
        with httpx.Client(base_url=url, timeout=30) as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
        out = subprocess.run(
            [sys.executable, "-c", README_EXAMPLE, name], capture_output=True, text=True, timeout=300, check=True
        )
        *content, completion_tokens = out.stdout.strip().splitlines()
        assert 1 <= int(completion_tokens) <= 32, out.stdout
        print("\n".join(content))
