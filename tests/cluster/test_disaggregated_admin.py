"""Acceptance 1, disaggregated: through the admin API, while clients keep sending requests, the
decode pool goes 1 → 2 replicas while the prefill pool stays at 1, and then the reverse (prefill
1 → 2 while decode stays at 1). No request fails, the router starts using each new replica, and
the pool left alone keeps its replica. Then one of two decode replicas is killed mid-stream: the
streams go on, and the prefill replica and the surviving decode replica hold no page. CPU cluster
(mode=disaggregated, KV over NIXL in host memory) shared with test_disaggregated.py, which runs first
(disagg_harness.py). Nothing here asserts on timings.
"""

import asyncio

import pytest

from cluster_harness import streams_across_a_kill
from disagg_harness import ADMIN, APP, MODEL, USER, all_idle_and_clean
from pools_harness import Load, running_ids, settle, wait_for

ray = pytest.importorskip("ray")
pytest.importorskip("nixl_cu13._api")
from ray import serve  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(disagg_cluster):
    return disagg_cluster


def _scale(http, pool: str, n: int) -> dict:
    r = http.post(f"/admin/pools/{pool}/scale", json={"replicas": n}, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def _pairs(rids) -> list:
    decided = serve.get_deployment_handle("Router", APP).decisions.remote().result(timeout_s=30)
    return [decided[rid].split(">") for rid in rids if rid in decided]


@pytest.mark.parametrize("grow, still", [("decode", "prefill"), ("prefill", "decode")])
def test_scale_one_pool_while_the_other_stays(cluster, http, grow, still):
    (kept,) = running_ids(settle(http, 1, still))
    (old,) = running_ids(settle(http, 1, grow))
    with Load(cluster, clients=3) as load:
        wait_for(lambda: load.count() >= 3, 180, "first requests")
        p = _scale(http, grow, 2)
        assert p["target_replicas"] == 2
        (new,) = set(running_ids(settle(http, 2, grow))) - {old}
        mark = load.count()
        wait_for(lambda: load.count() >= mark + 6, 180, "requests after the new replica joined")
        pairs = _pairs(load.rids(mark))
        side = 0 if grow == "prefill" else 1
        assert new in {pr[side] for pr in pairs}, "the router never used the new replica"
        assert {pr[1 - side] for pr in pairs} == {kept}
        other = settle(http, 1, still, timeout=5)
        assert running_ids(other) == [kept] and other["serve_target_replicas"] == 1
        _scale(http, grow, 1)  # back, still under load
        settle(http, 1, grow)
    assert load.failures() == [], load.failures()[:5]


def test_decode_replica_killed_mid_stream_streams_go_on(cluster, http):
    """Two decode replicas, 16 greedy streams on both; one decode replica is killed mid-stream: every
    stream goes on through a new pair from its tokens so far and ends with [DONE] and the text of an
    undisturbed run (the client sees one stream; the gap around the kill is printed)."""
    _scale(http, "decode", 2)
    decode = running_ids(settle(http, 2, "decode"))
    victim = sorted(decode)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Decode#{victim}", namespace="serve")
    greedy = dict(model=MODEL, max_tokens=24, temperature=0, ignore_eos=True)
    bodies = [dict(greedy, prompt=f"Note {i}: the harbour master wrote that") for i in range(16)]
    reference, results = asyncio.run(
        streams_across_a_kill(cluster, bodies, lambda: ray.kill(actor, no_restart=True), headers=USER)
    )
    assert [text for text, _ in results] == reference
    print("largest gap between events per stream (s):", sorted(round(gap, 2) for _, gap in results))
    # the prefill replica (the sender of every handoff) and the surviving decode replica hold nothing
    wait_for(lambda: all_idle_and_clean(http), 60, "no leak after the decode replica died")
    r = http.post("/v1/completions", json=dict(greedy, prompt="After the kill", max_tokens=4), headers=USER)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
