"""ClusterState: what the router knows about each worker — its approximate cache and its load.

Bookkeeping only; policies (policies.py) read it to choose, the router
deployment writes it:

    on_routed(worker, tokens)   a request was sent: in-flight += 1, tree.insert(prompt)
    on_finished(worker)         it finished or was aborted: in-flight -= 1
    on_report(worker, ...)      the worker's periodic report: queue length, KV usage,
                                drained CacheEvents (replayed onto its tree), capacity
    sync_members(ids)           membership follows the serving layer: new ids join with
                                empty trees, missing ones are purged (tree and counters)

Load (request units, lower is better):

    load = in_flight + queue_len + kv_usage_weight * kv_usage

in_flight counts this router's requests sent and not yet finished (known at once);
queue_len is the worker's reported waiting queue, which also covers requests from
other router replicas. A request of ours still waiting counts twice, which
deliberately penalises queues. kv_usage in [0, 1] adds up to `kv_usage_weight`
requests: a nearly full KV pool means new requests will wait or retract. Reported
values older than `report_ttl_s` are ignored (the worker may be stuck).

Room: a worker admits at most `capacity` requests (its engine's max_running_requests +
max_queued_requests, from its reports); `has_room` compares this router's in_flight with it, so the
router can refuse at once when every worker of a pool is full (policies.PoolFullError) instead of
letting each worker refuse. in_flight counts requests, the engine counts choices (n > 1 holds n):
the router's view is a lower bound, and a worker's own refusal stays the last word.

Not thread-safe: one event loop owns a ClusterState.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Iterable, List, Literal, Optional, Sequence

from cluster.router.tree import ApproximateTree

WorkerId = Hashable


@dataclass(frozen=True)
class RouterConfig:
    """Routing knobs; defaults follow SGLang's router."""

    cache_threshold: float = 0.5
    """cache_aware: route to the best-matching worker only if matched/len(prompt) > this."""
    balance_abs_threshold: float = 32.0
    """Imbalanced when max_load - min_load > this (and the relative test holds)."""
    balance_rel_threshold: float = 1.0001
    """Imbalanced when max_load > this * min_load (and the absolute test holds)."""
    miss_policy: Literal["least_loaded", "smallest_tree"] = "least_loaded"
    """cache_aware below the threshold: least loaded worker (ties: smaller tree), or
    SGLang's choice, the smallest tree (ties: lower load)."""
    max_tree_tokens: Optional[int] = 1 << 20
    """Size cap of each worker's approximate tree, in tokens; set near the worker's KV pool size."""
    page_size: int = 1
    """The workers' KV page size (how their radix caches key children)."""
    prefix_hash_tokens: int = 256
    """prefix_hash: how many leading tokens pick the worker."""
    kv_usage_weight: float = 8.0
    """Requests of load that a full KV pool (kv_usage = 1) adds."""
    report_ttl_s: float = 30.0
    """Reported queue length and KV usage older than this are ignored."""

    def __post_init__(self):
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.prefix_hash_tokens < 1:
            raise ValueError(f"prefix_hash_tokens must be >= 1, got {self.prefix_hash_tokens}")


@dataclass
class WorkerState:
    """One worker as the router sees it."""

    worker_id: WorkerId
    tree: ApproximateTree
    in_flight: int = 0
    """Requests routed here and not yet finished."""
    queue_len: int = 0
    """Waiting requests, as last reported."""
    kv_usage: float = 0.0
    """Fraction of the KV pool in use, as last reported."""
    last_report_time: Optional[float] = None
    """Clock reading of the last report; None before the first."""
    capacity: Optional[int] = None
    """Requests the worker admits (max_running_requests + max_queued_requests), as reported; None:
    unbounded, or not reported yet."""
    routed_requests: int = 0
    routed_tokens: int = 0
    matched_tokens: int = 0
    """Prompt tokens the tree already held when routed (the router's estimate of cache hits)."""
    events_applied: int = 0


@dataclass(frozen=True)
class RoutingStats:
    """What the router knows of one worker: its approximate tree, what it routed there, its load."""

    worker_id: WorkerId
    tree_tokens: int
    tree_nodes: int
    routed_requests: int
    routed_tokens: int
    matched_tokens: int
    in_flight: int
    queue_len: int
    kv_usage: float
    load: float

    @property
    def match_rate(self) -> float:
        return self.matched_tokens / self.routed_tokens if self.routed_tokens else 0.0


@dataclass(frozen=True)
class MembershipChange:
    added: List[WorkerId] = field(default_factory=list)
    removed: List[WorkerId] = field(default_factory=list)


class ClusterState:
    """Workers by id, in join order (policies break ties by that order)."""

    def __init__(self, config: Optional[RouterConfig] = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or RouterConfig()
        self.clock = clock
        self.workers: Dict[WorkerId, WorkerState] = {}

    @property
    def worker_ids(self) -> List[WorkerId]:
        return list(self.workers)

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, worker_id: WorkerId) -> bool:
        return worker_id in self.workers

    # --- membership ----------------------------------------------------------------------------

    def add_worker(self, worker_id: WorkerId) -> WorkerState:
        """Join with an empty tree; a known id keeps its state."""
        if worker_id not in self.workers:
            tree = ApproximateTree(self.config.max_tree_tokens, self.config.page_size)
            self.workers[worker_id] = WorkerState(worker_id, tree)
        return self.workers[worker_id]

    def remove_worker(self, worker_id: WorkerId) -> bool:
        """Purge the worker: its tree and counters are dropped. False if unknown."""
        return self.workers.pop(worker_id, None) is not None

    def sync_members(self, worker_ids: Iterable[WorkerId]) -> MembershipChange:
        wanted = list(dict.fromkeys(worker_ids))
        wanted_set = set(wanted)
        removed = [w for w in self.workers if w not in wanted_set]
        added = [w for w in wanted if w not in self.workers]
        for w in removed:
            self.remove_worker(w)
        for w in added:
            self.add_worker(w)
        return MembershipChange(added, removed)

    # --- updates -------------------------------------------------------------------------------

    def on_routed(self, worker_id: WorkerId, tokens: Sequence[int]) -> int:
        """Record a request sent to `worker_id`; inserts its prompt into the worker's tree.

        Returns the prompt tokens the tree held before (counted as matched). Unknown
        workers (purged meanwhile) are ignored and return 0.
        """
        worker = self.workers.get(worker_id)
        if worker is None:
            return 0
        matched = worker.tree.insert(tokens)
        worker.in_flight += 1
        worker.routed_requests += 1
        worker.routed_tokens += len(tokens)
        worker.matched_tokens += matched
        return matched

    def on_finished(self, worker_id: WorkerId) -> None:
        """A routed request finished, failed or was aborted."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.in_flight > 0:
            worker.in_flight -= 1

    def on_report(
        self,
        worker_id: WorkerId,
        queue_len: int,
        kv_usage: float,
        events: Iterable = (),
        capacity: Optional[int] = None,
    ) -> bool:
        """Take a worker's report; `events` are its CacheEvents in the order it drained them; `capacity`
        the requests it admits (None: unbounded).

        Returns False (and changes nothing) for an unknown worker.
        """
        worker = self.workers.get(worker_id)
        if worker is None:
            return False
        for event in events:
            worker.tree.apply_event(event)
            worker.events_applied += 1
        worker.queue_len = max(0, int(queue_len))
        worker.kv_usage = min(1.0, max(0.0, float(kv_usage)))
        worker.capacity = None if capacity is None else max(0, int(capacity))
        worker.last_report_time = self.clock()
        return True

    # --- queries -------------------------------------------------------------------------------

    def load(self, worker_id: WorkerId, now: Optional[float] = None) -> float:
        """in_flight + queue_len + kv_usage_weight * kv_usage (reported terms only while fresh)."""
        worker = self.workers[worker_id]
        load = float(worker.in_flight)
        if worker.last_report_time is None:
            return load
        if (self.clock() if now is None else now) - worker.last_report_time <= self.config.report_ttl_s:
            load += worker.queue_len + self.config.kv_usage_weight * worker.kv_usage
        return load

    def has_room(self, worker_id: WorkerId) -> bool:
        """The worker may take one more request: its capacity is unknown or above this router's in_flight."""
        worker = self.workers[worker_id]
        return worker.capacity is None or worker.in_flight < worker.capacity

    def capacity(self) -> Optional[int]:
        """Requests all workers admit together; None when any is unbounded or not reported yet (or none)."""
        caps = [w.capacity for w in self.workers.values()]
        if not caps or any(c is None for c in caps):
            return None
        return sum(caps)

    def loads(self) -> Dict[WorkerId, float]:
        now = self.clock()
        return {w: self.load(w, now) for w in self.workers}

    def match(self, worker_id: WorkerId, tokens: Sequence[int]) -> int:
        return self.workers[worker_id].tree.match(tokens)

    def stats(self) -> Dict[WorkerId, RoutingStats]:
        return {
            w: RoutingStats(
                worker_id=w,
                tree_tokens=s.tree.size(),
                tree_nodes=s.tree.num_nodes(),
                routed_requests=s.routed_requests,
                routed_tokens=s.routed_tokens,
                matched_tokens=s.matched_tokens,
                in_flight=s.in_flight,
                queue_len=s.queue_len,
                kv_usage=s.kv_usage,
                load=self.load(w),
            )
            for w, s in self.workers.items()
        }
