"""Router core (cluster/router): approximate tree, event replay, cluster state, policies."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, Set, Tuple

import pytest

from cluster.router import (
    ApproximateTree,
    ClusterState,
    NoWorkersError,
    PoolFullError,
    PoolRouter,
    RouterConfig,
    available_policies,
    make_policy,
)


@dataclass
class Event:
    """Duck-typed stand-in for engine.memory.radix_cache.CacheEvent."""

    kind: str
    token_ids: Tuple[int, ...]
    num_tokens: int


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prefix_set_match(cached: Set[Tuple[int, ...]], query: Sequence[int]) -> int:
    """Reference: `cached` is prefix-closed; the match is the longest prefix of query in it."""
    n = 0
    while n < len(query) and tuple(query[: n + 1]) in cached:
        n += 1
    return n


# ---- tree: insert / match -------------------------------------------------------------------
def test_insert_and_match():
    tree = ApproximateTree()
    assert tree.insert([1, 2, 3, 4]) == 0
    assert tree.insert([1, 2, 5, 6]) == 2  # returns the prefix already present
    assert tree.match([1, 2, 3, 4, 9]) == 4
    assert tree.match([1, 2, 5]) == 3
    assert tree.match([1, 7]) == 1 and tree.match([8]) == 0 and tree.match([]) == 0
    assert tree.size() == 6 and sorted(tree.paths()) == [(1, 2, 3, 4), (1, 2, 5, 6)]
    assert tree.insert((1, 2, 3)) == 3 and tree.size() == 6  # tuples work; no new tokens


def test_match_inside_long_run_finds_exact_divergence():
    tree = ApproximateTree()
    base = list(range(1000, 3000))
    tree.insert(base)
    for cut in (1, 2, 63, 64, 65, 1000, 1999):
        assert tree.match(base[:cut] + [7]) == cut
    assert tree.match(base + [5]) == 2000


def test_random_inserts_and_removals_agree_with_reference():
    rng = random.Random(0)
    for _ in range(200):
        tree, cached = ApproximateTree(), set()
        for _ in range(25):
            seq = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 8)))
            if rng.random() < 0.65:
                tree.insert(seq)
                cached.update(seq[:i] for i in range(1, len(seq) + 1))
            else:
                n = rng.randrange(1, len(seq) + 1)
                cut = len(seq) - n
                tree.remove_prefix(seq, n)
                if seq[: cut + 1] in cached:  # page_size 1: the branch seq[:cut + 1] goes
                    cached = {p for p in cached if p[: cut + 1] != seq[: cut + 1]}
            assert tree.size() == len(cached)
            for _ in range(4):
                q = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
                assert tree.match(q) == prefix_set_match(cached, q)


# ---- tree: LRU under the size cap -----------------------------------------------------------
def test_cap_evicts_least_recently_inserted_leaf():
    tree = ApproximateTree(max_tokens=6)
    tree.insert([1, 1, 1])
    tree.insert([2, 2, 2])
    tree.insert([1, 1, 1])  # refreshes [1, 1, 1]
    tree.insert([3, 3, 3])
    assert tree.size() == 6
    assert tree.match([2, 2, 2]) == 0 and tree.match([1, 1, 1]) == 3 and tree.match([3, 3, 3]) == 3


def test_match_does_not_refresh_lru():
    tree = ApproximateTree(max_tokens=4)
    tree.insert([1, 1])
    tree.insert([2, 2])
    tree.match([1, 1])
    tree.insert([3, 3])
    assert tree.match([1, 1]) == 0 and tree.match([2, 2]) == 2


def test_cap_cascades_to_parent_then_stops():
    tree = ApproximateTree(max_tokens=5)
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 4])
    tree.insert([9, 9, 9, 9])  # 8 tokens: leaves [3], [4], then their parent [1, 2] go
    assert tree.size() == 4 and tree.match([1]) == 0 and tree.match([9] * 4) == 4
    assert tree.num_nodes() == 1


def test_cap_holds_over_many_inserts():
    rng = random.Random(1)
    tree = ApproximateTree(max_tokens=500)
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(5)]
    last = None
    for _ in range(2000):
        last = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        tree.insert(last)
        assert tree.size() <= 500
    assert tree.match(last) == len(last)  # the newest path survives
    assert len(tree._leaf_heap) <= 2 * tree.num_nodes() + 1024  # lazy heap stays compact


# ---- tree: event replay ---------------------------------------------------------------------
def test_event_insert_then_evict():
    tree = ApproximateTree()
    tree.apply_event(Event("insert", (1, 2, 3, 4), 4))
    tree.apply_event(Event("insert", (1, 2, 5, 6), 2))
    assert tree.match([1, 2, 5, 6]) == 4
    assert tree.apply_event(Event("evict", (1, 2, 5, 6), 2)) == -2
    assert tree.match([1, 2, 5, 6]) == 2 and tree.match([1, 2, 3, 4]) == 4
    tree.apply_event(Event("evict", (1, 2, 3, 4), 2))
    tree.apply_event(Event("evict", (1, 2), 2))
    assert tree.size() == 0 and tree.num_nodes() == 0


def test_evict_cuts_router_only_extensions_but_keeps_siblings():
    tree = ApproximateTree()
    tree.insert([1, 2, 3, 4, 5, 6])  # routed: the worker had not reported it yet
    tree.insert([1, 2, 7])
    tree.apply_event(Event("evict", (1, 2, 3, 4), 2))  # nothing below an evicted leaf is cached
    assert sorted(tree.paths()) == [(1, 2, 7)]


def test_unknown_and_reordered_events_are_ignored():
    tree = ApproximateTree()
    tree.insert([1, 2, 3])
    assert tree.apply_event(Event("evict", (9, 9, 9), 3)) == 0  # never seen
    assert tree.apply_event(Event("evict", (1, 2, 8), 1)) == 0  # diverges
    assert tree.apply_event(Event("evict", (1, 2, 3, 4, 5), 2)) == 0  # beyond what is held
    assert tree.apply_event(Event("evict", (1, 2), 0)) == 0
    tree.apply_event(Event("evict", (1,), 1))  # parent before child (reset order) ...
    assert tree.apply_event(Event("evict", (1, 2, 3), 2)) == 0  # ... the child is already gone
    assert tree.size() == 0
    with pytest.raises(ValueError):
        tree.apply_event(Event("split", (1,), 1))


def test_evict_with_pages_keeps_sibling_sharing_part_of_first_page():
    tree = ApproximateTree(page_size=4)
    tree.apply_event(Event("insert", (1, 2, 3, 4), 4))
    tree.apply_event(Event("insert", (1, 2, 3, 4, 5, 5, 5, 5), 4))
    tree.apply_event(Event("insert", (1, 2, 3, 4, 5, 6, 6, 6), 4))  # worker: two children, keyed by page
    tree.apply_event(Event("evict", (1, 2, 3, 4, 5, 5, 5, 5), 4))
    assert tree.match([1, 2, 3, 4, 5, 6, 6, 6]) == 8 and tree.match([1, 2, 3, 4, 5, 5]) == 5
    tree.apply_event(Event("evict", (1, 2, 3, 4, 5, 6, 6, 6), 4))
    assert sorted(tree.paths()) == [(1, 2, 3, 4)] and tree.size() == 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_replaying_engine_events_mirrors_the_engine_cache(page_size):
    torch = pytest.importorskip("torch")
    from engine.memory.radix_cache import RadixCache

    class Allocator:
        def free(self, indices):
            pass

    rng = random.Random(page_size)
    cache = RadixCache(Allocator(), page_size=page_size)
    tree = ApproximateTree(page_size=page_size)
    bases = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        key = rng.choice(bases)[: rng.randrange(13)] + [rng.randrange(4) for _ in range(rng.randrange(12))]
        key = key[: len(key) - len(key) % page_size]
        if rng.random() < 0.7:
            cache.insert(key, torch.arange(len(key), dtype=torch.int64))
        else:
            cache.evict(rng.randrange(1, 20))
        if step % 7 == 0:
            cache.match_prefix(rng.choice(bases))  # changes the engine's LRU order only
        for event in cache.drain_events():
            tree.apply_event(event)
        if page_size == 1:
            assert tree.size() == cache.total_size()
        for _ in range(3):
            q = rng.choice(bases)[: rng.randrange(13)] + [rng.randrange(4) for _ in range(6)]
            engine_len = cache.match_prefix(q, record_stats=False).prefix_len
            assert tree.match(q) // page_size * page_size == engine_len
    cache.reset()
    for event in cache.drain_events():
        tree.apply_event(event)
    assert tree.size() == 0


# ---- cluster state --------------------------------------------------------------------------
def test_membership_join_and_purge():
    state = ClusterState()
    state.add_worker("a")
    state.on_routed("a", [1, 2, 3])
    change = state.sync_members(["a", "b", "c"])
    assert change.added == ["b", "c"] and change.removed == []
    assert state.stats()["b"].tree_tokens == 0 and state.stats()["a"].tree_tokens == 3
    change = state.sync_members(["c", "b"])
    assert change.removed == ["a"] and state.worker_ids == ["b", "c"]
    state.sync_members(["a", "b", "c"])  # rejoining starts empty
    assert state.stats()["a"].tree_tokens == 0 and state.workers["a"].routed_requests == 0
    assert state.remove_worker("a") and not state.remove_worker("a")
    state.on_routed("zz", [1])  # purged meanwhile: ignored
    state.on_finished("zz")
    assert not state.on_report("zz", 3, 0.5, [])


def test_routed_finished_and_stats():
    state = ClusterState()
    state.sync_members(["a"])
    assert state.on_routed("a", [1, 2, 3, 4]) == 0
    assert state.on_routed("a", [1, 2, 3, 9]) == 3
    stats = state.stats()["a"]
    assert (stats.routed_requests, stats.routed_tokens, stats.matched_tokens, stats.in_flight) == (2, 8, 3, 2)
    assert stats.match_rate == 3 / 8 and stats.tree_tokens == 5
    state.on_finished("a"), state.on_finished("a"), state.on_finished("a")
    assert state.workers["a"].in_flight == 0


def test_load_formula_and_stale_reports():
    clock = Clock()
    state = ClusterState(RouterConfig(kv_usage_weight=10.0, report_ttl_s=5.0), clock=clock)
    state.sync_members(["a"])
    state.on_routed("a", [1])
    state.on_routed("a", [2])
    assert state.load("a") == 2.0
    assert state.on_report("a", queue_len=3, kv_usage=0.5, events=[Event("insert", (7, 7), 2)])
    assert state.load("a") == 2 + 3 + 10 * 0.5
    assert state.match("a", [7, 7]) == 2 and state.workers["a"].events_applied == 1
    clock.now = 6.0  # the report went stale
    assert state.load("a") == 2.0


# ---- policies -------------------------------------------------------------------------------
def cluster(ids=("w0", "w1", "w2"), **cfg) -> ClusterState:
    state = ClusterState(RouterConfig(**cfg))
    state.sync_members(ids)
    return state


def set_load(state: ClusterState, worker: str, in_flight: int) -> None:
    state.workers[worker].in_flight = in_flight


def test_registry():
    assert available_policies() == ["cache_aware", "power_of_two", "prefix_hash", "random", "round_robin"]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope")
    for name in available_policies():
        with pytest.raises(NoWorkersError):
            make_policy(name).choose([1, 2], ClusterState())


def test_cache_aware_routes_to_best_prefix_match():
    state = cluster()
    prompt = list(range(100))
    state.workers["w1"].tree.insert(prompt[:80])
    state.workers["w2"].tree.insert(prompt[:30])
    set_load(state, "w1", 5)  # busier, but within the balance thresholds
    decision = make_policy("cache_aware", state.config).choose(prompt, state)
    assert (decision.worker_id, decision.matched_tokens, decision.reason) == ("w1", 80, "cache_hit")


@pytest.mark.parametrize("matched,expect", [(49, "cache_miss"), (50, "cache_miss"), (51, "cache_hit")])
def test_cache_threshold_boundary(matched, expect):
    state = cluster(cache_threshold=0.5)
    prompt = list(range(100))
    state.workers["w2"].tree.insert(prompt[:matched])
    set_load(state, "w2", 1)  # so that a miss goes elsewhere
    decision = make_policy("cache_aware", state.config).choose(prompt, state)
    assert decision.reason == expect
    assert decision.worker_id == ("w2" if expect == "cache_hit" else "w0")


def test_cache_miss_least_loaded_or_smallest_tree():
    for miss_policy, expect in (("least_loaded", "w1"), ("smallest_tree", "w2")):
        state = cluster(miss_policy=miss_policy)
        state.workers["w0"].tree.insert([7] * 50)
        state.workers["w1"].tree.insert([8] * 40)
        state.workers["w2"].tree.insert([9] * 10)
        set_load(state, "w0", 2)
        set_load(state, "w2", 1)
        decision = make_policy("cache_aware", state.config).choose([1, 2, 3], state)
        assert (decision.worker_id, decision.reason) == (expect, "cache_miss")


@pytest.mark.parametrize(
    "loads,imbalanced",
    [
        ((40, 10, 20), False),  # rel holds (40 > 10.001), abs fails (diff 30 <= 32)
        ((42, 10, 20), False),  # diff exactly 32: not > 32
        ((33, 33, 33), False),  # neither holds
        ((50, 10, 30), True),  # both: 40 > 32 and 50 > 10.001
        ((33, 0, 5), True),  # min load 0: the relative test holds for any positive max
    ],
)
def test_imbalance_thresholds(loads, imbalanced):
    state = cluster(balance_abs_threshold=32, balance_rel_threshold=1.0001)
    for worker, load in zip(state.worker_ids, loads):
        set_load(state, worker, load)
    prompt = list(range(64))
    state.workers["w0"].tree.insert(prompt)  # a perfect match on the busiest worker
    decision = make_policy("cache_aware", state.config).choose(prompt, state)
    if imbalanced:
        assert (decision.worker_id, decision.reason) == ("w1", "imbalanced")
    else:
        assert (decision.worker_id, decision.reason) == ("w0", "cache_hit")


def test_imbalance_needs_both_thresholds():
    prompt = list(range(64))
    # abs holds (diff 100 > 32), rel fails (1000 <= 1.2 * 900): not imbalanced
    state = cluster(("a", "b"), balance_rel_threshold=1.2)
    set_load(state, "a", 1000), set_load(state, "b", 900)
    state.workers["a"].tree.insert(prompt)
    assert make_policy("cache_aware", state.config).choose(prompt, state).reason == "cache_hit"
    # rel holds (10 > 1.0001 * 1), abs fails (diff 9 <= 32): not imbalanced
    state = cluster(("a", "b"))
    set_load(state, "a", 10), set_load(state, "b", 1)
    state.workers["a"].tree.insert(prompt)
    assert make_policy("cache_aware", state.config).choose(prompt, state).reason == "cache_hit"
    # both hold: the least loaded wins despite the match
    set_load(state, "a", 40)
    decision = make_policy("cache_aware", state.config).choose(prompt, state)
    assert (decision.worker_id, decision.reason) == ("b", "imbalanced")


def test_router_route_inserts_and_finishes():
    router = PoolRouter("cache_aware", RouterConfig(), random.Random(0))
    router.state.sync_members(["w0", "w1"])
    prompt = list(range(200))
    first = router.route(prompt)
    assert first.reason == "cache_miss" and first.matched_tokens == 0
    again = router.route(prompt + [7, 7])
    assert (again.worker_id, again.reason, again.matched_tokens) == (first.worker_id, "cache_hit", 200)
    other = router.route(list(range(500, 600)))
    assert other.worker_id != first.worker_id  # a miss goes to the less loaded worker
    router.finish(first.worker_id)
    assert router.state.workers[first.worker_id].in_flight == 1


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two", "random", "prefix_hash"])
def test_full_workers_are_skipped_then_the_pool_is_full(policy):
    """A worker whose in_flight reached its reported capacity is not chosen; when every worker is full
    (or excluded: it refused the request) route() raises PoolFullError and records nothing."""
    router = PoolRouter(policy, RouterConfig(), random.Random(0))
    router.state.sync_members(["w0", "w1"])
    assert router.route([1, 2, 3]).pool_capacity is None  # no report yet: unbounded, never full
    for w, cap in (("w0", 2), ("w1", 3)):
        router.state.on_report(w, 0, 0.0, capacity=cap)
    for w in ("w0", "w1"):  # clear what the first route counted
        router.finish(w)
    chosen = [router.route([1, 2, 3]) for _ in range(5)]
    assert [d.pool_capacity for d in chosen] == [5] * 5
    assert {w: router.state.workers[w].in_flight for w in ("w0", "w1")} == {"w0": 2, "w1": 3}
    routed = sum(w.routed_requests for w in router.state.workers.values())
    with pytest.raises(PoolFullError, match="all 2 worker"):
        router.route([1, 2, 3])
    assert sum(w.routed_requests for w in router.state.workers.values()) == routed
    assert router.state.workers["w0"].in_flight == 2
    router.finish("w1")
    assert router.route([9, 9]).worker_id == "w1"  # room again
    router.finish("w0")
    with pytest.raises(PoolFullError, match="refused this request"):
        router.route([5], exclude=["w0"])  # w1 full, w0 refused already
    assert router.route([5], exclude=["w1"]).worker_id == "w0"


def test_excluded_worker_is_replaced_by_least_loaded_with_room():
    router = PoolRouter("cache_aware", RouterConfig(), random.Random(0))
    router.state.sync_members(["w0", "w1", "w2"])
    prompt = list(range(100))
    first = router.route(prompt)
    router.route(list(range(300, 400)))  # loads another worker
    again = router.route(prompt, exclude=[first.worker_id])
    assert again.reason == "room" and again.worker_id not in (first.worker_id,)
    assert router.state.load(again.worker_id) == 1  # the idle one of the two left
    unchecked = PoolRouter("round_robin", RouterConfig())
    unchecked.state.sync_members(["w0"])
    unchecked.state.on_report("w0", 0, 0.0, capacity=0)
    assert unchecked.route([1], check_room=False).worker_id == "w0"  # prefill pool: room not checked
    with pytest.raises(PoolFullError):
        unchecked.route([1])
    with pytest.raises(NoWorkersError):
        PoolRouter("random").route([1], exclude=["w0"])  # empty pool: no_workers, not full


def test_round_robin_cycles_and_follows_membership():
    state = cluster()
    policy = make_policy("round_robin")
    assert [policy.choose([1], state).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    state.remove_worker("w1")
    assert {policy.choose([1], state).worker_id for _ in range(4)} == {"w0", "w2"}


def test_power_of_two_picks_the_lower_of_two():
    state = cluster(("a", "b", "c", "d"))
    for worker, load in zip(state.worker_ids, (4, 1, 3, 2)):
        set_load(state, worker, load)
    policy = make_policy("power_of_two", rng=random.Random(0))
    mirror = random.Random(0)
    for _ in range(50):
        x, y = mirror.sample(state.worker_ids, 2)
        expect = min((x, y), key=state.load)
        assert policy.choose([1], state).worker_id == expect
    assert make_policy("power_of_two").choose([1], cluster(("solo",))).worker_id == "solo"


def test_random_is_seeded_and_covers_workers():
    state = cluster()
    picks = [make_policy("random", rng=random.Random(3)).choose([1], state).worker_id for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first choice
    policy = make_policy("random", rng=random.Random(3))
    assert {policy.choose([1], state).worker_id for _ in range(60)} == set(state.worker_ids)


def test_prefix_hash_uses_only_the_first_k_tokens_and_reports_matches():
    state = cluster(prefix_hash_tokens=4)
    policy = make_policy("prefix_hash", state.config)
    a = policy.choose([1, 2, 3, 4, 5, 6], state)
    assert policy.choose([1, 2, 3, 4, 9, 9, 9], state).worker_id == a.worker_id
    state.on_routed(a.worker_id, [1, 2, 3, 4, 5, 6])
    assert policy.choose([1, 2, 3, 4, 5], state).matched_tokens == 5


def test_prefix_hash_is_stable_when_workers_join_and_leave():
    rng = random.Random(0)
    keys = [[rng.randrange(30000) for _ in range(8)] for _ in range(2000)]
    state = cluster([f"w{i}" for i in range(8)])
    policy = make_policy("prefix_hash", state.config)
    before = [policy.choose(k, state).worker_id for k in keys]
    assert len(set(before)) == 8
    state.add_worker("w8")
    after = [policy.choose(k, state).worker_id for k in keys]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == "w8" for _, a in moved)  # only keys the newcomer wins move
    assert 0.05 < len(moved) / len(keys) < 0.2  # about 1/9
    state.remove_worker("w3")
    again = [policy.choose(k, state).worker_id for k in keys]
    assert all(x == y for x, y in zip(after, again) if x != "w3")
