"""Routing policies: a small abstract base, a registry by name, and the `PoolRouter` façade.

A policy's `choose(input_ids, state)` only decides; it never writes the state
(beyond its own counter or random generator). The caller records the choice with
`state.on_routed(worker, input_ids)`, which inserts the prompt into the chosen
worker's approximate tree — for every policy, so cache statistics stay comparable.
`PoolRouter.route` does both in one call.

    cache_aware   SGLang's algorithm (see CacheAwarePolicy)
    round_robin   workers in join order, in turn
    power_of_two  two distinct workers at random, the lower load wins
    random        uniform
    prefix_hash   rendezvous hashing of the first `prefix_hash_tokens` tokens: adding or
                  removing a worker moves only the keys that it wins or held
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Collection, Dict, List, Optional, Sequence, Tuple, Type

from cluster.router.state import ClusterState, RouterConfig, WorkerId


class NoWorkersError(RuntimeError):
    """The cluster has no worker to route to."""


class PoolFullError(RuntimeError):
    """Every worker of the pool holds as many requests as it admits (by the router's count), or refused
    this request already: the caller answers 503 queue_full with Retry-After, no worker is called."""


@dataclass(frozen=True)
class RoutingDecision:
    worker_id: WorkerId
    matched_tokens: int
    """Prompt tokens the chosen worker's approximate tree holds (estimated cache hit)."""
    reason: str
    """cache_hit | cache_miss | imbalanced (cache_aware), else the policy's name; `room` when the policy's
    choice was full (or excluded) and the least loaded worker with room took the request."""
    pool_capacity: Optional[int] = None
    """Requests the pool's workers admit together (ClusterState.capacity); None: unbounded or unknown."""


@dataclass(frozen=True)
class RouteRequest:
    """One prompt to place (RouterDeployment.route_many takes a list of them)."""

    input_ids: List[int]
    rid: Optional[str] = None
    """The request's id (the router remembers where it went); None: not remembered."""
    exclude: Tuple[str, ...] = ()
    """Workers that refused this request already (queue full): not chosen again."""


@dataclass(frozen=True)
class Finished:
    """A request that left a worker (RouterDeployment.finish_many takes a list of them)."""

    worker_id: WorkerId
    pool: str = "unified"
    timing: Optional[Any] = None
    """The ingress's cluster.latency.RequestTiming of the request (None: not measured)."""


class RoutingPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, config: Optional[RouterConfig] = None, rng: Optional[random.Random] = None):
        self.config = config or RouterConfig()
        self.rng = rng or random.Random()

    @abstractmethod
    def choose(self, input_ids: Sequence[int], state: ClusterState) -> RoutingDecision:
        """Pick a worker for a prompt; raises NoWorkersError on an empty cluster."""

    @staticmethod
    def _workers(state: ClusterState) -> List[WorkerId]:
        if not state.workers:
            raise NoWorkersError("no workers to route to")
        return state.worker_ids

    def _decide(
        self, worker_id: WorkerId, input_ids: Sequence[int], state: ClusterState, reason: Optional[str] = None
    ) -> RoutingDecision:
        return RoutingDecision(worker_id, state.match(worker_id, input_ids), reason or self.name)


_REGISTRY: Dict[str, Type[RoutingPolicy]] = {}


def register_policy(name: str) -> Callable[[Type[RoutingPolicy]], Type[RoutingPolicy]]:
    def wrap(cls: Type[RoutingPolicy]) -> Type[RoutingPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_policies() -> List[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, config: Optional[RouterConfig] = None, rng: Optional[random.Random] = None) -> RoutingPolicy:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {available_policies()}") from None
    return cls(config, rng)


@register_policy("cache_aware")
class CacheAwarePolicy(RoutingPolicy):
    """SGLang's cache-aware routing.

    1. Imbalanced — max_load - min_load > balance_abs_threshold AND
       max_load > balance_rel_threshold * min_load — route to the least loaded worker.
    2. Else match the prompt against every worker's tree. If the best match rate
       matched / len(prompt) > cache_threshold, route to that worker (ties: lower load).
    3. Else (a miss) route to the least loaded worker (ties: smaller tree),
       or with miss_policy="smallest_tree" to SGLang's choice, the smallest tree.
    Remaining ties go to the earlier-joined worker.
    """

    def choose(self, input_ids: Sequence[int], state: ClusterState) -> RoutingDecision:
        workers = self._workers(state)
        cfg = self.config
        tokens = input_ids if isinstance(input_ids, tuple) else tuple(input_ids)
        loads = state.loads()
        sizes = {w: state.workers[w].tree.size() for w in workers}
        max_load, min_load = max(loads.values()), min(loads.values())
        if max_load - min_load > cfg.balance_abs_threshold and max_load > cfg.balance_rel_threshold * min_load:
            target = min(workers, key=lambda w: (loads[w], sizes[w]))
            return RoutingDecision(target, state.match(target, tokens), "imbalanced")
        matches = {w: state.match(w, tokens) for w in workers}
        best = max(workers, key=lambda w: (matches[w], -loads[w]))
        if tokens and matches[best] / len(tokens) > cfg.cache_threshold:
            return RoutingDecision(best, matches[best], "cache_hit")
        if cfg.miss_policy == "smallest_tree":
            target = min(workers, key=lambda w: (sizes[w], loads[w]))
        else:
            target = min(workers, key=lambda w: (loads[w], sizes[w]))
        return RoutingDecision(target, matches[target], "cache_miss")


@register_policy("round_robin")
class RoundRobinPolicy(RoutingPolicy):
    def __init__(self, config: Optional[RouterConfig] = None, rng: Optional[random.Random] = None):
        super().__init__(config, rng)
        self._next = 0

    def choose(self, input_ids: Sequence[int], state: ClusterState) -> RoutingDecision:
        workers = self._workers(state)
        target = workers[self._next % len(workers)]
        self._next += 1
        return self._decide(target, input_ids, state)


@register_policy("power_of_two")
class PowerOfTwoPolicy(RoutingPolicy):
    """Sample two distinct workers; the lower load wins (ties: the first sampled)."""

    def choose(self, input_ids: Sequence[int], state: ClusterState) -> RoutingDecision:
        workers = self._workers(state)
        if len(workers) == 1:
            return self._decide(workers[0], input_ids, state)
        a, b = self.rng.sample(workers, 2)
        target = b if state.load(b) < state.load(a) else a
        return self._decide(target, input_ids, state)


@register_policy("random")
class RandomPolicy(RoutingPolicy):
    def choose(self, input_ids: Sequence[int], state: ClusterState) -> RoutingDecision:
        return self._decide(self.rng.choice(self._workers(state)), input_ids, state)


@register_policy("prefix_hash")
class PrefixHashPolicy(RoutingPolicy):
    """Rendezvous (highest random weight) hashing of the first prefix_hash_tokens tokens.

    Each worker scores hash(prefix digest, worker id); the highest score wins. A new
    worker takes only the keys it now scores highest on (about 1/n of them); a removed
    worker's keys spread over the rest; every other key keeps its worker. Hashes are
    blake2b, so choices agree across processes and router replicas.
    """

    def choose(self, input_ids: Sequence[int], state: ClusterState) -> RoutingDecision:
        workers = self._workers(state)
        prefix = array("q", input_ids[: self.config.prefix_hash_tokens]).tobytes()
        digest = hashlib.blake2b(prefix, digest_size=16).digest()
        target = max(workers, key=lambda w: _score(digest, w))
        return self._decide(target, input_ids, state)


def _score(digest: bytes, worker_id: WorkerId) -> bytes:
    return hashlib.blake2b(str(worker_id).encode(), digest_size=8, key=digest).digest()


class PoolRouter:
    """The routing of one worker pool: one policy over one ClusterState, both built from the same RouterConfig
    (the Serve deployment, RouterDeployment in router.py, holds one per pool)."""

    def __init__(
        self,
        policy: str = "cache_aware",
        config: Optional[RouterConfig] = None,
        rng: Optional[random.Random] = None,
        state: Optional[ClusterState] = None,
    ):
        self.config = config or (state.config if state is not None else RouterConfig())
        self.state = state or ClusterState(self.config)
        self.policy = make_policy(policy, self.config, rng)

    def route(
        self, input_ids: Sequence[int], exclude: Collection[WorkerId] = (), check_room: bool = True
    ) -> RoutingDecision:
        """Choose a worker and record the request as in flight there (prompt into its tree).

        Workers in `exclude` (they refused this request already) are never chosen; with `check_room`, nor
        are full ones (ClusterState.has_room). When the policy picks one of those, the least loaded worker
        left takes the request (reason "room"); when none is left, PoolFullError (NoWorkersError when the
        pool is empty)."""
        state = self.state
        workers = RoutingPolicy._workers(state)
        allowed = [w for w in workers if w not in exclude and (not check_room or state.has_room(w))]
        if not allowed:
            raise PoolFullError(
                f"all {len(workers)} worker(s) of the pool are full"
                + (f" or refused this request ({len(exclude)})" if exclude else "")
            )
        decision = self.policy.choose(input_ids, state)
        if decision.worker_id not in allowed:
            loads = state.loads()
            target = min(allowed, key=lambda w: loads[w])
            decision = RoutingDecision(target, state.match(target, input_ids), "room")
        state.on_routed(decision.worker_id, input_ids)
        return dataclasses.replace(decision, pool_capacity=state.capacity())

    def finish(self, worker_id: WorkerId) -> None:
        self.state.on_finished(worker_id)
