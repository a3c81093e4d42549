"""Pool sizing logic without Ray: PoolController decisions, ScaleRequest validation, latency
windows, the ingress's request clock and the replica status the scaler reports. The cluster tests
(test_admin*.py) run it for real."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from cluster.config import ClusterArgs
from cluster.ingress.latency import RequestClock
from cluster.latency import BUCKETS_S, LatencyWindow
from cluster.scaling.models import ScaleRequest
from cluster.scaling.policy import PoolController, PoolSignals, PoolSpec, p90, scaling_config

AUTO = {
    "min_replicas": 1,
    "max_replicas": 3,
    "target_waiting_per_replica": 2,
    "target_kv_usage": 0.8,
    "ttft_target_ms": 500,
    "itl_target_ms": 50,
    "upscale_delay_s": 2,
    "downscale_delay_s": 5,
}


def _ctl(auto=AUTO, initial=1) -> PoolController:
    return PoolController(PoolSpec(name="decode", deployment="Decode", initial_replicas=initial, autoscaling=auto))


def _sig(ready=1, waiting=0, kv=0.0, ttft=None, itl=None, running=0) -> PoolSignals:
    return PoolSignals(ready=ready, waiting=waiting, running=running, kv_usage=kv, ttft_p90_ms=ttft, itl_p90_ms=itl)


@pytest.mark.parametrize("hot", [dict(waiting=3), dict(kv=0.9), dict(ttft=800.0), dict(itl=80.0)])
def test_each_llm_signal_scales_up_after_the_delay(hot):
    ctl = _ctl()
    assert ctl.decide(_sig(**hot), now=0.0).target == 1
    assert ctl.decide(_sig(**hot), now=1.9).target == 1  # not held long enough
    d = ctl.decide(_sig(**hot), now=2.0)
    assert d.target == 2 and d.reason.startswith("scale up")


def test_no_second_step_while_new_replicas_start_and_max_holds():
    ctl = _ctl()
    for t in (0.0, 2.0):
        ctl.decide(_sig(ready=1, waiting=10), now=t)
    assert ctl.target == 2
    assert ctl.decide(_sig(ready=1, waiting=10), now=10.0).target == 2  # the second replica is not up yet
    assert ctl.decide(_sig(ready=2, waiting=10), now=12.0).target == 3
    assert ctl.decide(_sig(ready=3, waiting=30), now=20.0).target == 3  # max_replicas


def test_a_hot_blip_resets_the_timer():
    ctl = _ctl()
    ctl.decide(_sig(waiting=5), now=0.0)
    ctl.decide(_sig(waiting=0), now=1.0)
    assert ctl.decide(_sig(waiting=5), now=2.5).target == 1
    assert ctl.decide(_sig(waiting=5), now=4.5).target == 2


def test_scales_down_only_when_cold_for_the_delay_and_never_below_min():
    ctl = _ctl(initial=3)
    assert ctl.decide(_sig(ready=3, kv=0.5), now=0.0).target == 3  # KV above half its target: not cold
    assert ctl.decide(_sig(ready=3, itl=30.0), now=1.0).target == 3  # ITL above half its target
    ctl.decide(_sig(ready=3), now=2.0)
    assert ctl.decide(_sig(ready=3), now=6.9).target == 3
    assert ctl.decide(_sig(ready=3), now=7.0).target == 2
    assert ctl.decide(_sig(ready=2), now=12.0).target == 1
    assert ctl.decide(_sig(ready=1), now=100.0).target == 1


def test_manual_mode_and_bounds_from_the_operator():
    ctl = _ctl()
    ctl.set_replicas(5)
    assert not ctl.auto and ctl.decide(_sig(waiting=100), now=0.0).target == 5
    assert ctl.decide(_sig(), now=1000.0).target == 5
    ctl.set_autoscaling(min_replicas=2, max_replicas=4)
    assert ctl.auto and ctl.target == 4 and (ctl.min_replicas, ctl.max_replicas) == (2, 4)
    ctl.set_autoscaling(max_replicas=2)
    assert ctl.target == 2
    with pytest.raises(ValueError, match="min_replicas"):
        ctl.set_autoscaling(min_replicas=3)
    fixed = _ctl(auto=None, initial=2)
    assert not fixed.auto and fixed.decide(_sig(waiting=100), now=0).target == 2
    fixed.set_autoscaling()
    assert fixed.auto and (fixed.min_replicas, fixed.max_replicas) == (1, 4)


def test_scale_request_validation():
    assert ScaleRequest(replicas=2).replicas == 2
    assert ScaleRequest(autoscaling=True).autoscaling
    assert ScaleRequest(min_replicas=1, max_replicas=3).max_replicas == 3
    for bad in (
        {},
        {"replicas": 0},
        {"replicas": 65},
        {"replicas": 2, "autoscaling": True},
        {"replicas": 2, "max_replicas": 3},
        {"min_replicas": 3, "max_replicas": 1},
        {"autoscaling": False, "min_replicas": 1},
        {"size": 2},
    ):
        with pytest.raises(ValidationError):
            ScaleRequest(**bad)


def test_scaling_config_follows_cluster_args():
    cfg = scaling_config(ClusterArgs(workers=2, autoscaling='{"max_replicas": 5}'))
    (spec,) = cfg.pools
    assert (spec.name, spec.deployment, spec.initial_replicas) == ("unified", "Worker", 2)
    assert spec.autoscaling["max_replicas"] == 5
    assert scaling_config(ClusterArgs()).nonce != cfg.nonce  # a redeploy never follows old targets
    dis = scaling_config(ClusterArgs(mode="disaggregated", prefill_workers=1, decode_workers=2))
    assert [(p.name, p.deployment, p.initial_replicas, p.autoscaling) for p in dis.pools] == [
        ("prefill", "Prefill", 1, None),
        ("decode", "Decode", 2, None),
    ]


def test_replica_status_shows_the_gpus_each_replica_reported():
    """A replica's GPUs and tensor-parallel ranks (WorkerBase reports Ray's reservation and the engine's
    tensor_parallel_size with its stats) reach the admin API's ReplicaStatus; None until it reports."""
    from cluster import membership
    from cluster.scaling.loop import PoolScaler
    from cluster.workers.stats import WorkerStats
    from engine.outputs import EngineStats

    deployment_id = SimpleNamespace(app_name="unit-gpus", name="Worker")
    membership.publish(deployment_id, ids=frozenset({"r-tp4", "r-new"}))
    engine = EngineStats(**{**dict.fromkeys(EngineStats.__dataclass_fields__, 0), "running": 2})
    reports = {"r-tp4": WorkerStats(engine, capacity=None, gpus=4.0, tensor_parallel_size=4)}
    pool = SimpleNamespace(  # the router deployment's pool as the scaler reads it (ScaledPool)
        handle=None,
        deployment_id=deployment_id,
        routed_workers=dict,
        worker_stats=lambda: reports,
        resync_members=lambda: None,
    )
    scaler = PoolScaler(scaling_config(ClusterArgs(workers=2)), {"unified": pool}, "unit-gpus")
    status = scaler.pool_status("unified").model_dump(mode="json")
    replicas = {r["replica_id"]: r for r in status["replicas"]}
    assert (replicas["r-tp4"]["gpus"], replicas["r-tp4"]["tensor_parallel_size"], replicas["r-tp4"]["running"]) == (
        4.0,
        4,
        2,
    )
    assert (replicas["r-new"]["gpus"], replicas["r-new"]["tensor_parallel_size"]) == (None, None)


def test_latency_window_and_histogram():
    w = LatencyWindow(window_s=10)
    for i, ms in enumerate([5.0, 50.0, 500.0, 5000.0]):
        w.observe(ms, now=float(i))
    assert w.recent(now=5.0) == [5.0, 50.0, 500.0, 5000.0]
    assert w.recent(now=11.5) == [500.0, 5000.0]  # samples older than 10 s dropped
    buckets = dict(w.histogram.cumulative())
    assert buckets["0.005"] == 1 and buckets["0.1"] == 2 and buckets["+Inf"] == 4
    assert len(buckets) == len(BUCKETS_S) + 1 and w.histogram.total == pytest.approx(5.555)
    assert p90([]) is None and p90([1.0]) == 1.0 and p90([float(i) for i in range(1, 11)]) == 9.0


def test_request_clock():
    clock = RequestClock()
    out = SimpleNamespace
    clock.on_chunk([out(new_token_ids=[])])  # no tokens: not a first token
    assert clock.timing().ttft_ms is None
    clock.on_chunk([out(new_token_ids=[1])])
    clock.on_chunk([out(new_token_ids=[2, 3]), out(new_token_ids=[4])])
    t = clock.timing()
    assert t.ttft_ms is not None and t.ttft_ms >= 0 and t.itl_ms is not None and t.output_tokens == 4
