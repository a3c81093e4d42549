"""WorkerStats, what a worker reports: built by the replica, pickled to the router, read by attribute by the
ingress, and flattened in one place into the JSON of GET /router/stats (workers[*].engine). No Ray cluster."""

import asyncio
import dataclasses
import json
import pickle
import sys
from types import SimpleNamespace

import pytest

from cluster.workers.stats import EarlyPrefillCounters, HandoffCounters, WorkerStats
from engine.outputs import EngineStats

VIEW_KEYS = [
    "pool",
    "tree_tokens",
    "tree_nodes",
    "routed_requests",
    "routed_tokens",
    "matched_tokens",
    "in_flight",
    "capacity",
    "queue_len",
    "kv_usage",
    "load",
    "events_applied",
    "engine",
]
"""The keys of one worker in GET /router/stats, in order (the dashboard, tests and benchmarks read them)."""

HANDOFF_KEYS = [
    "handoff_requests",
    "handoff_notified",
    "handoff_reserve_s",
    "handoff_ready_s",
    "handoff_calls",
    "handoff_call_s",
    "handoff_prefill_compute_s",
    "handoff_prefill_transfer_s",
    "handoff_call_out_s",
    "handoff_call_back_s",
]
"""A decode replica's keys in workers[*].engine of GET /router/stats, in order (benchmarks, tests read them)."""

EARLY_PREFILL_KEYS = [
    "early_prefill_started",
    "early_prefill_claimed",
    "early_prefill_dropped",
    "early_prefill_skipped",
    "early_prefill_held",
]
"""A prefill replica's keys in workers[*].engine of GET /router/stats, in order."""


def engine_stats(**fields) -> EngineStats:
    """An EngineStats of distinct values (so that a field read in place of another shows), with `fields`."""
    values = {f.name: i + 1 for i, f in enumerate(dataclasses.fields(EngineStats))}
    values.update(kv_usage=0.25, cache_hit_rate=0.5)
    return EngineStats(**{**values, **fields})


def worker_stats(**fields) -> WorkerStats:
    own = dict(capacity=12, gpus=2.0, tensor_parallel_size=2, first_output_s=1.5, first_output_requests=3)
    return WorkerStats(fields.pop("engine", engine_stats()), **{**own, **fields})


def test_worker_stats_is_torch_and_ray_free():
    import subprocess

    code = "import sys, cluster.workers.stats; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_as_dict_is_the_flat_shape_the_workers_reported():
    """as_dict is what the replica's stats dict was: the engine's fields, the replica's first-output counters
    and placement, then its role's counters, every value a float (the JSON of /router/stats)."""
    counters = HandoffCounters(requests=4, reserve_s=0.125)
    s = worker_stats(role_counters=counters)
    legacy = {
        **s.engine.as_dict(),
        "first_output_s": 1.5,
        "first_output_requests": 3,
        "gpus": 2.0,
        "tensor_parallel_size": 2.0,
        **dict.fromkeys(HANDOFF_KEYS, 0.0),
        "handoff_requests": 4,
        "handoff_reserve_s": 0.125,
    }
    assert json.dumps(s.as_dict()) == json.dumps({k: float(v) for k, v in legacy.items()})
    assert "capacity" not in s.as_dict()  # the worker's view has a field of its own for it


@pytest.mark.parametrize(
    "counters, keys",
    [
        (EarlyPrefillCounters(started=5, claimed=3, dropped=1, skipped=2, held=1), EARLY_PREFILL_KEYS),
        (
            HandoffCounters(
                requests=4,
                notified=2,
                reserve_s=0.5,
                ready_s=0.25,
                calls=4,
                call_s=1.5,
                prefill_compute_s=0.75,
                prefill_transfer_s=0.125,
                call_out_s=0.0625,
                call_back_s=0.03125,
            ),
            HANDOFF_KEYS,
        ),
        (None, []),
    ],
)
def test_role_counters_keep_their_json_keys(counters, keys):
    """Each role's typed counters become its flat keys after the replica's own, in order, as floats; the
    unified pool (None) adds none."""
    s = worker_stats(role_counters=counters)
    out = s.as_dict()
    base = len(s.engine.as_dict()) + 4  # then first_output_s, first_output_requests, gpus, tensor_parallel_size
    assert list(out)[base:] == keys
    if counters is not None:
        assert type(counters).keys() == tuple(keys)
        fields = [getattr(counters, f.name) for f in dataclasses.fields(counters)]
        assert [out[k] for k in keys] == [float(v) for v in fields]
        assert all(type(out[k]) is float for k in keys)


def test_role_counters_are_frozen_and_add_by_name():
    c = HandoffCounters().plus(requests=1, ready_s=0.5).plus(requests=1)
    assert (c.requests, c.ready_s, c.calls) == (2, 0.5, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.requests = 3
    with pytest.raises(TypeError):
        EarlyPrefillCounters().plus(handoff_requests=1)  # names are the fields, not the JSON keys


def test_roles_report_their_typed_counters():
    """A prefill replica reports its StartedPrompts' EarlyPrefillCounters, a decode replica its HandoffCounters."""
    from cluster.workers.decode import DecodeWorker
    from cluster.workers.early_prefill import StartedPrompts
    from cluster.workers.prefill import PrefillWorker

    prefill = PrefillWorker.__new__(PrefillWorker)
    prefill.started = StartedPrompts(engine=None, limit_tokens=0, ttl_s=1.0)
    prefill.started.start([1], None, "k")  # over the limit: skipped
    assert prefill._role_counters() == EarlyPrefillCounters(skipped=1)
    decode = DecodeWorker.__new__(DecodeWorker)
    decode._handoff = HandoffCounters(requests=2)
    assert decode._role_counters() == HandoffCounters(requests=2)


def test_worker_stats_crosses_the_replica_boundary_whole():
    s = worker_stats(role_counters=EarlyPrefillCounters(started=1, held=1))
    back = pickle.loads(pickle.dumps(s))
    assert back == s and isinstance(back.engine, EngineStats) and back.engine.kv_usage == 0.25
    assert isinstance(back.role_counters, EarlyPrefillCounters) and back.role_counters.started == 1


def _view(reported):
    from cluster.router.router import WorkerView

    return WorkerView(
        pool="unified",
        tree_tokens=5,
        tree_nodes=2,
        routed_requests=1,
        routed_tokens=5,
        matched_tokens=0,
        in_flight=0,
        capacity=reported.capacity if reported is not None else None,
        queue_len=0,
        kv_usage=0.25,
        load=0.25,
        events_applied=1,
        reported=reported,
    )


def _cluster_stats(workers):
    from cluster.router.router import ClusterStats

    return ClusterStats(
        policy="cache_aware",
        workers=workers,
        routed_requests=1,
        cache_hit_rate=0.0,
        route_latency_ms={},
        membership_changes=0,
        purged_workers=[],
    )


def test_router_stats_json_keeps_its_shape():
    """GET /router/stats (ClusterStats.model_dump) shows each worker's report flat under "engine" ({} before
    its first report) and never the typed record itself; the typed record crosses to the ingress."""
    s = worker_stats(role_counters=EarlyPrefillCounters())
    stats = _cluster_stats({"w1": _view(s), "w2": _view(None)})
    out = json.loads(json.dumps(stats.model_dump()))
    assert list(out["workers"]["w1"]) == VIEW_KEYS
    assert out["workers"]["w1"]["engine"] == s.as_dict() and out["workers"]["w1"]["capacity"] == 12
    assert out["workers"]["w1"]["engine"]["early_prefill_held"] == 0.0
    assert out["workers"]["w2"]["engine"] == {} and out["workers"]["w2"]["capacity"] is None
    assert json.loads(stats.model_dump_json()) == out
    back = pickle.loads(pickle.dumps(stats))  # Ray's way from the router to the ingress
    assert back.workers["w1"].reported == s and back.workers["w2"].reported is None


def test_report_sends_worker_stats():
    """WorkerBase.report(): the engine's stats, the replica's own figures and its role's counters, typed."""
    from cluster.workers.unified import Worker

    class Engine:
        config = SimpleNamespace(admission_limit=None, tensor_parallel_size=4)

        async def stats_async(self):
            return engine_stats(waiting=7)

        async def drain_cache_events_async(self):
            return ["event"]

        def shutdown(self):
            pass

    worker = Worker.__new__(Worker)
    worker.replica_id, worker.engine, worker._gpus = "me", Engine(), 4.0
    worker._first_output_s, worker._first_output_requests = 0.0, 0
    worker._count_first_output(0.0)
    report = asyncio.run(worker.report())
    assert (report.replica_id, report.events) == ("me", ["event"])
    s = report.stats
    assert (s.engine.waiting, s.capacity, s.gpus, s.tensor_parallel_size, s.role_counters) == (7, None, 4.0, 4, None)
    assert s.first_output_requests == 1 and s.first_output_s > 0
    assert asyncio.run(worker.stats()).engine == s.engine


def test_ingress_reads_worker_stats_by_attribute():
    """The ingress's pool load (ServingLoad) and per-worker gauges come from the typed reports; a worker not
    reported yet counts as idle (0)."""
    from cluster.ingress.backend import ClusterBackend
    from cluster.ingress.metrics import WorkerGauges

    kv = dict(kv_total_tokens=100, kv_free_tokens=60, kv_evictable_tokens=30)
    a = worker_stats(engine=engine_stats(running=3, waiting=1, kv_usage=0.5, **kv))
    b = worker_stats(engine=engine_stats(running=2, waiting=0, kv_usage=0.25, kv_free_tokens=70))
    stats = _cluster_stats({"a": _view(a), "b": _view(b), "new": _view(None)})

    async def remote_stats():
        return stats

    backend = ClusterBackend.__new__(ClusterBackend)
    backend.router = SimpleNamespace(stats=SimpleNamespace(remote=remote_stats))
    load = asyncio.run(backend.stats())
    assert (load.running, load.waiting, load.kv_usage) == (5, 1, 0.25)
    b_kv = (b.engine.kv_total_tokens, b.engine.kv_evictable_tokens)
    assert (load.kv_total_tokens, load.kv_free_tokens, load.kv_evictable_tokens) == (100 + b_kv[0], 130, 30 + b_kv[1])

    families = {f.name: f for f in WorkerGauges(backend, "m").collect()}
    running = {s.labels["replica"]: s.value for s in families["radixserve_worker_num_requests_running"].samples}
    assert running == {"a": 3.0, "b": 2.0, "new": 0.0}
    routed = {s.labels["replica"]: s.value for s in families["radixserve_router_routed_requests"].samples}
    assert routed == {"a": 1.0, "b": 1.0, "new": 1.0}


def test_a_report_reaches_the_router_without_torch():
    """The router's process never loads torch: the cache events and stats of a worker's report (made here by a
    real RadixCache) unpickle without it."""
    import subprocess

    from engine.memory.allocator import TokenToKVPoolAllocator
    from engine.memory.radix_cache import RadixCache

    alloc = TokenToKVPoolAllocator(num_pages=8, page_size=1)
    cache = RadixCache(alloc, page_size=1)
    cache.insert([1, 2, 3], alloc.alloc_pages(3))
    events = cache.drain_events()
    assert [e.kind for e in events] == ["insert"]
    data = pickle.dumps((worker_stats(), events))
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True).stdout
    assert out.strip() == b"False"
