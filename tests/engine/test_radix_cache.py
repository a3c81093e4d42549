"""RadixCache: unit tests, plus a stateful property test against a page-level reference model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.memory.radix_cache import RadixCache
from engine.outputs import CacheEvent


class FakeAllocator:
    """Test double: hands out whole pages of fresh slots and catches double frees."""

    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.live: set = set()
        self.freed: List[int] = []
        self._next_page = 1  # page 0 reserved, as in the real allocator

    def alloc(self, n: int) -> torch.Tensor:
        """Slots of ceil(n / page_size) fresh pages (len is a page multiple >= n)."""
        num_pages = -(-n // self.page_size)
        start = self._next_page * self.page_size
        self._next_page += num_pages
        slots = list(range(start, start + num_pages * self.page_size))
        self.live.update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64 and indices.dim() == 1
        slots = indices.tolist()
        ps = self.page_size
        assert len(slots) % ps == 0, "frees come in whole pages"
        for i in range(0, len(slots), ps):
            page = slots[i : i + ps]
            assert page == list(range(page[0], page[0] + ps)) and page[0] % ps == 0, page
        for s in slots:
            assert s in self.live, f"double free of slot {s}"
            self.live.remove(s)
        self.freed.extend(slots)


def make(page_size: int = 1, **kw) -> Tuple[RadixCache, FakeAllocator]:
    alloc = FakeAllocator(page_size)
    return RadixCache(alloc, page_size=page_size, **kw), alloc


def put(cache: RadixCache, alloc: FakeAllocator, key: List[int]) -> torch.Tensor:
    """Insert `key` with fresh slots, freeing duplicates as a caller would; returns the slots."""
    value = alloc.alloc(len(key))[: len(key)]
    n = cache.insert(key, value)
    alloc.free(value[:n])
    return value


# ---- insert / match ------------------------------------------------------------------
def test_insert_then_match_returns_inserted_slots():
    cache, alloc = make()
    value = put(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.prefix_len == 4 and m.indices.tolist() == value.tolist()
    assert m.indices.dtype == torch.int64
    assert cache.match_prefix([9]).prefix_len == 0
    assert cache.match_prefix([9]).last_node is cache.root
    assert cache.match_prefix([]).indices.shape == (0,)


def test_insert_returns_already_cached_prefix_len():
    cache, alloc = make()
    first = put(cache, alloc, [1, 2, 3])
    value = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], value) == 3
    alloc.free(value[:3])
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == first.tolist() + value[3:].tolist()
    assert cache.total_size() == 5


def test_match_splits_node_inside_run():
    cache, alloc = make()
    value = put(cache, alloc, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.prefix_len == 3 and m.indices.tolist() == value[:3].tolist()
    assert m.last_node.key == [1, 2, 3]
    assert list(m.last_node.children.values())[0].key == [4, 5]
    assert cache.total_size() == 5 and alloc.freed == []  # split changes no ownership


def test_insert_splits_at_divergence():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    assert cache.insert([1, 2, 7, 8], alloc.alloc(4)) == 2
    top = cache.root.children[1]
    assert top.key == [1, 2] and sorted(c.key[0] for c in top.children.values()) == [3, 7]


def test_tensor_key_and_value_is_copied():
    cache, alloc = make()
    value = alloc.alloc(3)
    cache.insert(torch.tensor([5, 6, 7]), value)
    expected = value.tolist()
    value.fill_(-1)  # e.g. the caller's req_to_token row gets reused
    assert cache.match_prefix(torch.tensor([5, 6, 7])).indices.tolist() == expected


def test_insert_rejects_value_of_wrong_length():
    cache, alloc = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(2))


# ---- pages -------------------------------------------------------------------------------
def test_page_size_16_matches_whole_pages_only():
    ps = 16
    cache, alloc = make(ps)
    key = list(range(40))
    slots = alloc.alloc(40)
    assert cache.insert(key, slots[:40]) == 0  # the partial third page is dropped
    alloc.free(slots[32:])
    assert cache.total_size() == 32
    assert cache.match_prefix(key).prefix_len == 32
    assert cache.match_prefix(key[:31]).prefix_len == 16
    diverge = key[:20] + [999] + key[21:]  # differs inside page 2: only page 1 matches
    m = cache.match_prefix(diverge)
    assert m.prefix_len == 16 and m.indices.tolist() == slots[:16].tolist()
    assert m.last_node.key == key[:16]  # split at the page boundary
    assert set(cache.root.children) == {tuple(range(16))}  # children keyed by first page
    assert all(isinstance(k, tuple) and len(k) == ps for k in m.last_node.children)


def test_page_size_4_insert_diverging_inside_page():
    cache, alloc = make(4)
    put(cache, alloc, [0, 0, 0, 0, 1, 1, 1, 1])
    assert cache.insert([0, 0, 0, 0, 1, 1, 1, 2], alloc.alloc(8)) == 4
    top = cache.root.children[(0, 0, 0, 0)]
    assert set(top.children) == {(1, 1, 1, 1), (1, 1, 1, 2)}


# ---- locks and eviction --------------------------------------------------------------------
def test_lock_protects_path_from_eviction():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size(), cache.total_size()) == (4, 2, 6)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert cache.match_prefix([1, 2, 5, 6]).prefix_len == 2
    cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    assert cache.evict(100) == 4 and cache.total_size() == 0
    assert alloc.live == set()


def test_lock_survives_split_of_locked_node():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2])  # splits the locked node
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4


def test_dec_lock_ref_on_unlocked_path_raises_and_changes_nothing():
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    put(cache, alloc, [1, 2, 3])
    parent = cache.match_prefix([1, 2]).last_node
    child = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(parent)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(child)  # child itself is not locked
    assert parent.lock_ref == 1 and cache.protected_size() == 2


def test_lock_of_evicted_node_raises():
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(node)


def test_evict_takes_least_recently_used_leaf_first():
    cache, alloc = make()
    a, b, c = (put(cache, alloc, k) for k in ([1, 1], [2, 2], [3, 3]))
    cache.match_prefix([1, 1])  # a is now the most recent
    assert cache.evict(1) == 2 and alloc.freed == b.tolist()
    assert cache.evict(2) == 2 and alloc.freed == b.tolist() + c.tolist()
    assert cache.match_prefix([1, 1]).prefix_len == 2


def test_evict_cascades_to_parent_and_stops_when_enough():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    put(cache, alloc, [9] * 5)
    cache.match_prefix([9])  # [9]*5 splits into [9] + [9]*4; both recent
    assert cache.evict(3) == 4  # leaves [3], [4], then their parent [1, 2] (the oldest)
    assert cache.match_prefix([1]).prefix_len == 0
    assert cache.total_size() == 5 and cache.evictable_size() == 5
    assert cache.evict(0) == 0
    assert cache.evict(1) == 4  # the leaf [9]*4 goes whole
    assert cache.total_size() == 1


# ---- events, disable, reset, stats ------------------------------------------------------------
def test_events_report_full_paths():
    cache, alloc = make(2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6, 7])  # odd tail dropped
    assert cache.drain_events() == [CacheEvent("insert", (1, 2, 3, 4), 4), CacheEvent("insert", (1, 2, 5, 6), 2)]
    assert cache.drain_events() == []
    cache.match_prefix([1, 2, 5, 6])  # [3, 4] is now the oldest leaf
    assert cache.evict(6) == 6
    assert cache.drain_events() == [
        CacheEvent("evict", (1, 2, 3, 4), 2),
        CacheEvent("evict", (1, 2, 5, 6), 2),
        CacheEvent("evict", (1, 2), 2),
    ]


def test_events_can_be_disabled():
    cache, alloc = make(enable_events=False)
    put(cache, alloc, [1, 2])
    cache.evict(2)
    assert cache.drain_events() == []


def test_disabled_cache_stores_and_frees_nothing():
    cache, alloc = make(disable=True)
    value = alloc.alloc(3)
    assert cache.insert([1, 2, 3], value) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.prefix_len == 0 and m.last_node is cache.root and m.indices.numel() == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0 and alloc.freed == []
    assert cache.drain_events() == []
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)


def test_reset_frees_everything_and_refuses_while_locked():
    cache, alloc = make(4)
    for key in ([0] * 8, [0] * 4 + [1] * 4, [2] * 4):
        put(cache, alloc, key)
    cache.drain_events()
    node = cache.match_prefix([2] * 4).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.live == set() and cache.total_size() == 0 and cache.evictable_size() == 0
    assert sum(e.num_tokens for e in cache.drain_events() if e.kind == "evict") == 16
    assert cache.match_prefix([0] * 8).prefix_len == 0
    put(cache, alloc, [0] * 4)
    assert cache.match_prefix([0] * 8).prefix_len == 4


def test_stats_count_match_calls():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    assert cache.stats.hit_rate == 0.0
    cache.match_prefix([1, 2, 3, 4])
    cache.match_prefix([1, 2, 7, 7])
    cache.match_prefix([1, 2, 3, 4], record_stats=False)
    assert (cache.stats.queried_tokens, cache.stats.matched_tokens) == (8, 6)
    assert cache.stats.hit_rate == pytest.approx(0.75)


def test_works_with_the_real_allocator():
    allocator_mod = pytest.importorskip("engine.memory.allocator")
    alloc = allocator_mod.TokenToKVPoolAllocator(num_pages=8, page_size=4)
    cache = RadixCache(alloc, page_size=4)
    pages = alloc.alloc_pages(2)
    slots = (pages[:, None] * 4 + torch.arange(4)).flatten()
    assert cache.insert(list(range(8)), slots) == 0
    assert cache.evict(8) == 8 and alloc.available_size() == alloc.size


# ---- property test against a reference model ---------------------------------------------------
@dataclass
class Request:
    key: List[int]
    node: object
    prefix_len: int
    slots: List[int]  # value for key, then the unused rest of its last page


Prefix = Tuple[int, ...]


class RadixCacheMachine(RuleBasedStateMachine):
    """Reference model: every cached page as {prefix through that page: (slots, last access tick)}.

    The cache must hold exactly the model's pages (with the same slots and ticks), replaying
    its events must rebuild the model's page set, and every slot handed out is either in the
    tree, held by an in-flight request, or freed exactly once.
    """

    page_size = 1

    def __init__(self):
        super().__init__()
        self.alloc = FakeAllocator(self.page_size)
        self.cache = RadixCache(self.alloc, page_size=self.page_size)
        self.pages: Dict[Prefix, Tuple[Tuple[int, ...], int]] = {}
        self.replayed: set = set()
        self.clock = 0
        self.requests: List[Request] = []
        self.queried = self.matched = 0

    # -- model helpers
    def _page_prefixes(self, key: List[int]) -> List[Prefix]:
        ps = self.page_size
        return [tuple(key[:end]) for end in range(ps, len(key) - len(key) % ps + 1, ps)]

    def _model_match(self, key: List[int]) -> Tuple[int, List[int]]:
        slots: List[int] = []
        for prefix in self._page_prefixes(key):
            if prefix not in self.pages:
                break
            slots.extend(self.pages[prefix][0])
        return len(slots), slots

    def _touch(self, key: List[int], upto: int) -> None:
        for prefix in self._page_prefixes(key[:upto]):
            self.pages[prefix] = (self.pages[prefix][0], self.clock)

    def _do_match(self, key: List[int]):
        self.clock += 1
        m = self.cache.match_prefix(key)
        n, slots = self._model_match(key)
        assert m.prefix_len == n and m.indices.tolist() == slots
        self._touch(key, n)
        self.queried += len(key)
        self.matched += n
        return m

    def _do_insert(self, key: List[int], slots: List[int], owned_from: int) -> None:
        """Insert key (value = slots[:len(key)]); free duplicates [owned_from, n) and the partial page."""
        ps = self.page_size
        self.clock += 1
        n = self.cache.insert(key, torch.tensor(slots[: len(key)], dtype=torch.int64))
        assert n == self._model_match(key)[0] and n >= owned_from
        aligned = len(key) - len(key) % ps
        for end in range(n + ps, aligned + 1, ps):
            self.pages[tuple(key[:end])] = (tuple(slots[end - ps : end]), self.clock)
        self._touch(key, n)
        self._free_own(slots[owned_from:n] + slots[aligned:])

    def _free_own(self, slots: List[int]) -> None:
        if slots:
            self.alloc.free(torch.tensor(slots, dtype=torch.int64))

    def _replay(self, events: List[CacheEvent]) -> None:
        """Apply events to `replayed` as the router would, checking each is consistent."""
        ps = self.page_size
        for e in events:
            length = len(e.token_ids)
            assert e.num_tokens > 0 and e.num_tokens % ps == 0 and length % ps == 0
            pages = {e.token_ids[:end] for end in range(length - e.num_tokens + ps, length + 1, ps)}
            if e.kind == "insert":
                assert length == e.num_tokens or e.token_ids[: length - e.num_tokens] in self.replayed
                assert not pages & self.replayed
                self.replayed |= pages
            else:
                assert pages <= self.replayed
                assert not any(len(p) > length and p[:length] == e.token_ids for p in self.replayed)
                self.replayed -= pages

    # -- rules
    keys = st.nothing()  # each page-size subclass sets its key strategy

    @rule(data=st.data())
    def insert_fresh(self, data):
        key = data.draw(self.keys)
        self._do_insert(key, self.alloc.alloc(len(key)).tolist(), owned_from=0)

    @rule(data=st.data())
    def match(self, data):
        self._do_match(data.draw(self.keys))

    @rule(data=st.data())
    def start_request(self, data):
        key = data.draw(self.keys)
        m = self._do_match(key)
        self.cache.inc_lock_ref(m.last_node)
        own = self.alloc.alloc(len(key) - m.prefix_len).tolist()
        self.requests.append(Request(key, m.last_node, m.prefix_len, m.indices.tolist() + own))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish_request(self, data, cache_it):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if cache_it:
            self._do_insert(req.key, req.slots, owned_from=req.prefix_len)
        else:  # aborted: the request frees what it owns
            self._free_own(req.slots[req.prefix_len :])
        self.cache.dec_lock_ref(req.node)

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens):
        ps = self.page_size
        self._replay(self.cache.drain_events())
        evictable_before, freed_before = self.cache.evictable_size(), len(self.alloc.freed)
        freed = self.cache.evict(num_tokens)
        gone = set(self.alloc.freed[freed_before:])
        events = self.cache.drain_events()
        sizes = [e.num_tokens for e in events]
        assert all(e.kind == "evict" for e in events) and sum(sizes) == freed == len(gone)
        assert freed >= num_tokens or self.cache.evictable_size() == 0
        assert not sizes or sum(sizes[:-1]) < num_tokens  # stopped as soon as enough was freed
        assert self.cache.evictable_size() == evictable_before - freed
        evicted = {p: t for p, (slots, t) in self.pages.items() if set(slots) <= gone}
        assert all(not set(self.pages[p][0]) & gone for p in self.pages.keys() - evicted.keys())
        locked = self._locked_pages()
        assert not evicted.keys() & locked
        for p in evicted:
            del self.pages[p]
        # LRU: nothing evicted is newer than an unlocked leaf page that stayed
        parents = {p[:-ps] for p in self.pages}
        leaves = [t for p, (_, t) in self.pages.items() if p not in parents and p not in locked]
        if evicted and leaves:
            assert max(evicted.values()) <= min(leaves)
        self._replay(events)

    @rule()
    def reset(self):
        if self._locked_pages():  # requests that matched nothing hold only the root
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.cache.reset()
        self.pages.clear()

    # -- invariants
    def _locked_pages(self) -> set:
        return {p for r in self.requests for p in self._page_prefixes(r.key[: r.prefix_len])}

    @invariant()
    def tree_matches_model(self):
        cache, ps = self.cache, self.page_size
        found: Dict[Prefix, Tuple[Tuple[int, ...], int]] = {}
        stack = [(cache.root, ())]
        while stack:
            node, path = stack.pop()
            for ck, child in node.children.items():
                assert child.parent is node and child.value is not None
                assert len(child.key) > 0 and len(child.key) % ps == 0 and child.value.numel() == len(child.key)
                assert ck == (child.key[0] if ps == 1 else tuple(child.key[:ps]))
                assert 0 <= child.lock_ref <= node.lock_ref or node is cache.root
                full = path + tuple(child.key)
                locks = sum(1 for r in self.requests if r.prefix_len >= len(full) and tuple(r.key[: len(full)]) == full)
                assert child.lock_ref == locks
                values = child.value.tolist()
                for end in range(ps, len(child.key) + 1, ps):
                    found[path + tuple(child.key[:end])] = (tuple(values[end - ps : end]), child.last_access_time)
                stack.append((child, full))
        assert found == self.pages

    @invariant()
    def sizes_locks_and_slots_add_up(self):
        cache, ps = self.cache, self.page_size
        assert cache.total_size() == ps * len(self.pages)
        assert cache.protected_size() == ps * len(self._locked_pages())
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        in_tree = [s for slots, _ in self.pages.values() for s in slots]
        held = [s for r in self.requests for s in r.slots[r.prefix_len :]]
        assert len(set(in_tree + held)) == len(in_tree) + len(held)
        assert self.alloc.live == set(in_tree + held)  # no leak
        assert len(set(self.alloc.freed)) == len(self.alloc.freed)  # never freed twice
        for r in self.requests:
            assert self._model_match(r.key[: r.prefix_len])[1] == r.slots[: r.prefix_len]
        assert (cache.stats.queried_tokens, cache.stats.matched_tokens) == (self.queried, self.matched)

    @invariant()
    def events_replay_to_model(self):
        self._replay(self.cache.drain_events())
        assert self.replayed == set(self.pages)


def _keys(page_size: int):
    """Keys built from a few overlapping pages (so prefixes are shared and diverge mid-page)."""
    if page_size == 1:
        page = st.sampled_from([[0], [1], [2]])
    else:
        page = st.sampled_from([[0] * page_size, [0] * (page_size - 1) + [1], [1] + [0] * (page_size - 1)])
    tail = st.lists(st.integers(0, 1), max_size=page_size - 1)
    return st.builds(lambda pages, t: [tok for p in pages for tok in p] + t, st.lists(page, max_size=6), tail)


_settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class PageSize1Machine(RadixCacheMachine):
    page_size = 1
    keys = _keys(1)


class PageSize4Machine(RadixCacheMachine):
    page_size = 4
    keys = _keys(4)


TestRadixCachePageSize1 = PageSize1Machine.TestCase
TestRadixCachePageSize1.settings = _settings
TestRadixCachePageSize4 = PageSize4Machine.TestCase
TestRadixCachePageSize4.settings = _settings
