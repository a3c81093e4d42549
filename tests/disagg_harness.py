"""One CPU cluster in mode=disaggregated shared by test_disaggregated.py and test_disaggregated_admin.py
(the `disagg_cluster` fixture of tests/cluster/conftest.py): deployed by the first of them on Ray and Serve
that the modules before them started (cluster_harness.SHARED_SERVE), so the two modules pay the
application's start-up once and Ray's not at all.

The cluster: 1 prefill + 1 decode replica of the default model, KV handed over through NIXL over host
memory (UCX), pages of 4 tokens, round_robin routing (a new replica gets requests at once), the API key
and the distinct admin key of pools_harness.py (/router/stats needs the admin key), report_interval_s
0.25, a KV transfer timeout of 20 s and Serve health checks every second (a killed replica is replaced
soon). test_disaggregated.py runs first on the fresh cluster and leaves one replica per pool; the admin
tests settle each pool's size before they scale it.
"""

import asyncio

import httpx

from cluster_harness import router_stats
from pools_harness import ADMIN, ADMIN_KEY, API_KEY, USER  # noqa: F401 - USER is used by the test modules

APP = "radixserve-pd"
MODEL = "SmolLM2-135M-Instruct"
PAGE = 4


def args(**overrides):
    """The shared cluster's ClusterArgs; `overrides` replace fields (another module's own cluster)."""
    from cluster.config import ClusterArgs

    fields = dict(
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=1,
        kv_transfer="nixl",
        policy="round_robin",
        num_cpus=0.5,
        max_total_tokens=4096,
        page_size=PAGE,
        report_interval_s=0.25,
        kv_transfer_timeout_s=20,
        health_check_period_s=1.0,
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
    )
    return ClusterArgs(**{**fields, **overrides})


def pools(http) -> dict:
    """{pool: {worker id: its /router/stats entry}} of the cluster behind `http`."""
    out: dict = {}
    for wid, w in router_stats(http, ADMIN)["workers"].items():
        out.setdefault(w["pool"], {})[wid] = w
    return out


def all_idle_and_clean(http) -> bool:
    """Every live worker's last report: nothing in flight at the router, running, waiting or handed
    over, and every KV slot free or held by its radix cache."""
    by_pool = pools(http)
    if set(by_pool) != {"prefill", "decode"}:
        return False
    for workers in by_pool.values():
        for w in workers.values():
            e = w["engine"]
            if w["in_flight"] or not e or e["running"] or e["waiting"] or e.get("handoff_in_flight", 0):
                return False
            if e.get("early_prefill_held", 0):  # a prompt the ingress started, not claimed or dropped yet
                return False
            if e["kv_free_tokens"] + e["kv_evictable_tokens"] != e["kv_total_tokens"]:
                return False
    return True


def completions_at_once(base_url: str, prompts: list, max_tokens: int) -> list:
    """Greedy completions of every prompt, all sent at once (USER's key); their texts in prompt order."""

    async def run() -> list:
        async with httpx.AsyncClient(base_url=base_url, timeout=180, headers=USER) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions",
                        json=dict(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0.0),
                    )
                    for p in prompts
                )
            )

    rs = asyncio.run(run())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json()["choices"][0]["text"] for r in rs]
