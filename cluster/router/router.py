"""RouterDeployment: the single-replica Serve deployment that owns routing state.

    ingress ──route(input_ids, rid)──▶ Router.route (policy + ClusterState) ──▶ RoutingDecision
    ingress ──finish(worker_id)──────▶ in-flight -= 1
    control loop, every report_interval_s:
        membership  ◀── cluster.membership.members(): the worker replica set this process's handle
                        hears from the Serve controller (joiners start empty, leavers are purged)
        reports     ◀── Worker.report(), pinned to each member: queue length, KV usage, cache
                        events (replayed onto that worker's tree); a call failing because the
                        actor died purges the worker at once
    ingress ──stats()──▶ ClusterStats (GET /router/stats, /metrics)

One replica, one event loop: ClusterState is not thread-safe and every method here runs on the
replica's loop. Token streams never pass through here.
"""
import asyncio
import collections
import logging
import time
from typing import Any, Dict, List, Optional

from pydantic import BaseModel, Field
from ray.exceptions import ActorDiedError

from cluster import membership
from cluster.router.policies import NoWorkersError, Router, RoutingDecision
from cluster.router.state import RouterConfig

logger = logging.getLogger("ray.serve")

_MEMBERSHIP_WAIT_S = 60.0
"""route() waits this long for a first worker before raising NoWorkersError."""


class WorkerView(BaseModel):
    """One worker in ClusterStats."""
    tree_tokens: int = Field(description="Tokens in the router's approximate tree of this worker.")
    tree_nodes: int
    routed_requests: int = Field(description="Requests routed here since it joined.")
    routed_tokens: int
    matched_tokens: int = Field(description="Prompt tokens the tree held when routed (estimated cache hits).")
    in_flight: int
    queue_len: int
    kv_usage: float
    load: float
    events_applied: int
    engine: Dict[str, float] = Field(default_factory=dict, description="The worker's last engine.stats().")


class ClusterStats(BaseModel):
    policy: str
    workers: Dict[str, WorkerView]
    routed_requests: int
    cache_hit_rate: float = Field(description="Cached / prompt tokens over the live workers' engines.")
    route_latency_ms: Dict[str, float] = Field(description="Policy decision time in the router: p50, p99, max "
                                                         "over the last 4096 decisions.")
    membership_changes: int
    purged_workers: List[str] = Field(description="Recently purged worker replica ids (newest last).")


class RouterDeployment:
    async def __init__(self, workers, policy: str, router_config: Dict[str, Any], report_interval_s: float = 0.5):
        self.workers = workers
        self.router = Router(policy, RouterConfig(**router_config))
        self.policy = policy
        self.report_interval_s = report_interval_s
        self._latency_ms: collections.deque = collections.deque(maxlen=4096)
        self._decisions: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        self._engine_stats: Dict[str, Dict[str, float]] = {}
        self._purged: collections.deque = collections.deque(maxlen=64)
        self._members_version = -1
        self._membership_changes = 0
        self._members_ready = asyncio.Event()
        self._deployment_id = workers.deployment_id
        workers._init()  # start hearing the worker replica set now (pinning.members)
        self._loop_task = asyncio.get_running_loop().create_task(self._control_loop())

    # --- requests from the ingress -------------------------------------------------------------

    async def route(self, input_ids: List[int], rid: Optional[str] = None) -> RoutingDecision:
        self._sync_members()
        if not self.router.state.workers:
            try:
                await asyncio.wait_for(self._members_ready.wait(), _MEMBERSHIP_WAIT_S)
            except asyncio.TimeoutError:
                raise NoWorkersError("no worker replica is running") from None
            self._sync_members()
        start = time.perf_counter()
        decision = self.router.route(input_ids)
        self._latency_ms.append((time.perf_counter() - start) * 1e3)
        if rid is not None:
            self._decisions[rid] = decision.worker_id
            if len(self._decisions) > 4096:
                self._decisions.popitem(last=False)
        return decision

    def finish(self, worker_id: str) -> None:
        self.router.finish(worker_id)

    def decisions(self) -> Dict[str, str]:
        """rid → worker replica id of the last 4096 routed requests that named a rid."""
        return dict(self._decisions)

    def stats(self) -> ClusterStats:
        self._sync_members()
        state = self.router.state
        views = {}
        for wid, s in state.stats().items():
            views[wid] = WorkerView(tree_tokens=s.tree_tokens, tree_nodes=s.tree_nodes,
                                    routed_requests=s.routed_requests, routed_tokens=s.routed_tokens,
                                    matched_tokens=s.matched_tokens, in_flight=s.in_flight, queue_len=s.queue_len,
                                    kv_usage=s.kv_usage, load=s.load,
                                    events_applied=state.workers[wid].events_applied,
                                    engine=self._engine_stats.get(wid, {}))
        prompt = sum(v.engine.get("prompt_tokens", 0) for v in views.values())
        cached = sum(v.engine.get("cached_tokens", 0) for v in views.values())
        return ClusterStats(policy=self.policy, workers=views,
                            routed_requests=sum(v.routed_requests for v in views.values()),
                            cache_hit_rate=cached / prompt if prompt else 0.0,
                            route_latency_ms=percentiles(self._latency_ms),
                            membership_changes=self._membership_changes, purged_workers=list(self._purged))

    # --- membership and reports ----------------------------------------------------------------

    def _sync_members(self) -> None:
        m = membership.members(self._deployment_id)
        if m.version == self._members_version:
            return
        self._members_version = m.version
        change = self.router.state.sync_members(sorted(m.ids - m.dead))
        self._record_change(change.added, change.removed)

    def _purge(self, worker_id: str, why: str) -> None:
        if self.router.state.remove_worker(worker_id):
            self._record_change([], [worker_id])
            logger.warning("router: purged worker %s (%s)", worker_id, why)

    def _record_change(self, added: List[str], removed: List[str]) -> None:
        for w in removed:
            self._engine_stats.pop(w, None)
            self._purged.append(w)
        if added or removed:
            self._membership_changes += 1
            logger.info("router: workers +%s -%s", added, removed)
        if self.router.state.workers:
            self._members_ready.set()
        else:
            self._members_ready.clear()

    async def _control_loop(self) -> None:
        while True:
            try:
                self._sync_members()
                await self._poll_reports()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("router: control loop iteration failed")
            await asyncio.sleep(self.report_interval_s)

    async def _poll_reports(self) -> None:
        ids = list(self.router.state.workers)
        results = await asyncio.gather(*(self._report(w) for w in ids), return_exceptions=True)
        for wid, res in zip(ids, results):
            if isinstance(res, ActorDiedError):
                self._purge(wid, f"report failed: {type(res).__name__}")
                membership.mark_dead(self._deployment_id, wid)  # out until the controller drops it too
            elif isinstance(res, BaseException):
                logger.debug("router: report from %s failed: %r", wid, res)
            elif res.replica_id in self.router.state:
                # res may come from another replica when the pinned one just left (fallback routing)
                self.router.state.on_report(res.replica_id, res.queue_len, res.kv_usage, res.events)
                self._engine_stats[res.replica_id] = res.stats

    async def _report(self, worker_id: str):
        call = self.workers.options(session_id=worker_id).report.remote()
        return await asyncio.wait_for(call, timeout=max(5.0, 10 * self.report_interval_s))


def percentiles(samples) -> Dict[str, float]:
    """p50, p99, max and count of latency samples (ms)."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    xs = sorted(samples)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]

    return {"p50": q(0.5), "p99": q(0.99), "max": xs[-1], "count": len(xs)}
