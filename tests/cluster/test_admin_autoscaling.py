"""Acceptance 2: load drives the unified pool up (waiting requests above target), and it comes
back down once the load stops. CPU cluster shared with test_admin*.py (pools_harness.py):
autoscaling 1..2, target 1 waiting request per replica, engines running 2 requests at a time,
upscale delay 1 s, downscale delay 3 s. Nothing here asserts on timings."""

import pytest

from pools_harness import ADMIN, Load, http, pool, pools_cluster, running_ids, scale, settle, wait_for  # noqa: F401

pytestmark = pytest.mark.slow


def test_load_scales_the_pool_up_and_idleness_back_down(pools_cluster, http):
    scale(http, replicas=1)
    settle(http, 1)
    p = scale(http, autoscaling=True, min_replicas=1, max_replicas=2)
    assert (p["mode"], p["min_replicas"], p["max_replicas"], p["target_replicas"]) == ("autoscaling", 1, 2, 1)

    with Load(pools_cluster, clients=6, max_new_tokens=24) as load:
        up = wait_for(
            lambda: (lambda q: q if q["target_replicas"] == 2 else None)(pool(http)),
            180,
            "the autoscaler to raise the target",
        )
        assert up["last_decision"].startswith("scale up") and "waiting" in up["last_decision"]
        two = settle(http, 2)
        assert len(running_ids(two)) == 2
        history = pool(http)
    assert load.failures() == [], load.failures()[:5]
    # while loaded, the pool's history recorded the queue that triggered it
    full = http.get("/admin/pools/unified?history=true", headers=ADMIN).json()
    assert max(s["waiting"] for s in full["history"]) > 1 and max(s["tokens_per_s"] for s in full["history"]) > 0
    assert history["mode"] == "autoscaling"

    down = wait_for(
        lambda: (lambda q: q if q["target_replicas"] == 1 else None)(pool(http)),
        120,
        "the autoscaler to lower the target once idle",
    )
    assert down["last_decision"] == "scale down: idle"
    one = settle(http, 1)
    assert len(running_ids(one)) == 1 and one["mode"] == "autoscaling"
