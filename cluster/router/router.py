"""RouterDeployment: the single-replica Serve deployment that owns routing state.

One PoolRouter (policy + ClusterState of approximate trees) per worker pool: `unified` in unified
mode, `prefill` and `decode` in disaggregated mode.

    ingress ──route(input_ids, rid)──────▶ the unified pool's PoolRouter ──▶ RoutingDecision
    ingress ──route_pair(input_ids, rid)─▶ prefill + decode PoolRouter ──▶ PairDecision
    ingress ──finish(worker_id, pool, timing)─▶ in-flight -= 1; TTFT / ITL to the scaler; ingress totals
    control loop, every report_interval_s, for each pool:
        membership  ◀── cluster.membership.members(): the worker replica set this process's handle
                        hears from the Serve controller (joiners start empty, leavers are purged)
        reports     ◀── Worker.report(), pinned to each member: its WorkerStats (kept per worker; queue
                        length, KV usage and capacity feed the routing state) and cache events
                        (replayed onto that worker's tree); a call failing because the actor died
                        purges the worker at once
        scaler      ──▶ PoolScaler.step() (cluster/scaling/loop.py): pool sizes from LLM signals and the
                        operator's settings; drained replicas are left out of the routing set
    ingress ──stats()──▶ ClusterStats (GET /router/stats, /metrics)
    ingress ──admin_*()──▶ PoolScaler (GET/POST /admin/*, cluster/ingress/admin.py)
    ingress ──store_response / stored_response / delete_response──▶ the cluster's stored Responses API
                        responses (one LRU for every ingress replica; cluster/ingress/response_store.py)

One replica, one event loop: ClusterState is not thread-safe and every method here runs on the
replica's loop. Token streams never pass through here.
"""

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from pydantic import BaseModel, Field, InstanceOf, computed_field
from ray.exceptions import ActorDiedError

from cluster import membership
from cluster.router.policies import Finished, NoWorkersError, PoolFullError, PoolRouter, RouteRequest, RoutingDecision
from cluster.latency import IngressTotals, RequestTiming, percentiles
from cluster.router.state import RouterConfig, WorkerState
from cluster.scaling.loop import PoolScaler
from cluster.scaling.models import AdminError, ClusterPools, PoolStatus, ReplicaStatus, ScaleRequest
from cluster.scaling.policy import ScalingConfig
from cluster.workers.stats import WorkerStats
from serving.response_store import LruResponses, StoredResponse, StoreLimits

if TYPE_CHECKING:  # pragma: no cover
    from ray.serve.handle import DeploymentHandle

    from cluster.workers.base import WorkerReport

logger = logging.getLogger("ray.serve")

_MEMBERSHIP_WAIT_S = 60.0
"""route() waits this long for a first worker before raising NoWorkersError."""


@dataclass(frozen=True)
class PairDecision:
    """Disaggregated mode: where a request prefills and where it decodes."""

    prefill: RoutingDecision
    decode: RoutingDecision


class WorkerView(BaseModel):
    """One worker in ClusterStats."""

    pool: str = Field("unified", description="The worker's pool: unified, prefill or decode.")
    tree_tokens: int = Field(description="Tokens in the router's approximate tree of this worker.")
    tree_nodes: int
    routed_requests: int = Field(description="Requests routed here since it joined.")
    routed_tokens: int
    matched_tokens: int = Field(description="Prompt tokens the tree held when routed (estimated cache hits).")
    in_flight: int
    capacity: Optional[int] = Field(
        None, description="Requests the worker admits (max_running + max_queued), as reported; null: unbounded."
    )
    queue_len: int
    kv_usage: float
    load: float
    events_applied: int
    reported: Optional[InstanceOf[WorkerStats]] = Field(
        None, exclude=True, description="The worker's last report; None before the first."
    )

    @computed_field(description="The worker's last report, flat (WorkerStats.as_dict); {} before the first.")
    @property
    def engine(self) -> Dict[str, float]:
        return self.reported.as_dict() if self.reported is not None else {}


class ClusterStats(BaseModel):
    policy: str
    workers: Dict[str, WorkerView]
    routed_requests: int
    cache_hit_rate: float = Field(
        description="Cached / prompt tokens over the live workers' engines that compute "
        "prompts (unified and prefill pools)."
    )
    route_latency_ms: Dict[str, float] = Field(
        description="Policy decision time in the router: p50, p99, max over the last 4096 decisions."
    )
    membership_changes: int
    purged_workers: List[str] = Field(description="Recently purged worker replica ids (newest last).")
    ingress: Dict[str, float] = Field(
        default_factory=dict,
        description="Sums over every ingress replica's requests (cluster.latency.IngressTotals): route_rpc_s / "
        "route_rpc_calls (routing calls) and first_message_s / first_message_requests (worker call → first "
        "message); two snapshots give the means of an interval.",
    )


@dataclass
class _Pool:
    """One worker pool as the router deployment tracks it."""

    name: str
    handle: "DeploymentHandle"
    """The pool's Serve deployment (calls pinned by session_id)."""
    router: PoolRouter
    deployment_id: Any
    members_version: int = -1
    reports: Dict[str, WorkerStats] = field(default_factory=dict)
    """worker id → its last WorkerStats."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the pool has at least one worker."""

    # the scaler's view of the pool (cluster/scaling/loop.py ScaledPool)
    def routed_workers(self) -> Dict[str, WorkerState]:
        return self.router.state.workers

    def worker_stats(self) -> Dict[str, WorkerStats]:
        return self.reports

    def resync_members(self) -> None:
        self.members_version = -1  # differs from every membership version: the next sync recomputes


class RouterDeployment:
    async def __init__(
        self,
        pools: Dict[str, "DeploymentHandle"],
        policy: str,
        router_config: Dict[str, Any],
        report_interval_s: float = 0.5,
        scaling: Optional[ScalingConfig] = None,
        response_store: StoreLimits = StoreLimits(),
    ):
        """`pools`: pool name → DeploymentHandle of its workers ({"unified": h} or {"prefill": p, "decode": d}).
        `scaling`: pool sizing (cluster/scaling/loop.py); None: pools keep their size, no admin API.
        `response_store`: bounds of the stored /v1/responses responses (ClusterArgs.response_store_*)."""
        self.policy = policy
        self.report_interval_s = report_interval_s
        self.pools: Dict[str, _Pool] = {}
        for name, handle in pools.items():
            self.pools[name] = _Pool(
                name, handle, PoolRouter(policy, RouterConfig(**router_config)), handle.deployment_id
            )
            handle._init()  # start hearing the pool's replica set now (pinning → membership)
        self._latency_ms: collections.deque = collections.deque(maxlen=4096)
        self._decisions: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        self._purged: collections.deque = collections.deque(maxlen=64)
        self._membership_changes = 0
        self._ingress = IngressTotals()
        self.scaler = PoolScaler.in_replica(scaling, self.pools) if scaling is not None else None
        self.responses = LruResponses(response_store)
        """Stored /v1/responses responses (bounded by `response_store`); lost if this replica restarts."""
        self._loop_task = asyncio.get_running_loop().create_task(self._control_loop())

    # --- requests from the ingress -------------------------------------------------------------

    async def route(
        self,
        input_ids: List[int],
        rid: Optional[str] = None,
        pool: str = "unified",
        exclude: Sequence[str] = (),
    ) -> RoutingDecision:
        """Choose a worker of `pool` for a prompt, not one of `exclude` (they refused it) nor a full one;
        record it as in flight there. Raises PoolFullError when every worker is full or excluded."""
        decision = await self._route_in(self._pool(pool), input_ids, exclude)
        if rid is not None:
            self._remember(rid, decision.worker_id)
        return decision

    async def route_many(self, requests: List[RouteRequest], pool: str = "unified") -> List[Any]:
        """`route` for each request, in order: its RoutingDecision, or the NoWorkersError / PoolFullError
        that `route` would raise for it. One call for the prompts an ingress replica has waiting
        (serving/call_batcher.py): a call through Serve costs far more than a decision."""
        out: List[Any] = []
        for r in requests:
            try:
                out.append(await self.route(r.input_ids, r.rid, pool, r.exclude))
            except (NoWorkersError, PoolFullError) as exc:
                out.append(exc)
        return out

    async def route_pair(
        self, input_ids: List[int], rid: Optional[str] = None, exclude_decode: Sequence[str] = ()
    ) -> PairDecision:
        """Disaggregated mode: a prefill worker (cache-aware over the prefill trees) and a decode worker
        (cache-aware over the decode trees, so multi-turn conversations return to their KV; by load
        otherwise), not one of `exclude_decode` (they refused the request) nor a full one. Both are in
        flight until finish(). The prefill pool's in_flight counts a request until it ends, not only while
        its prompt computes, so room is checked on the decode pool only (a full prefill replica's own
        refusal moves the request to a new pair)."""
        prefill = await self._route_in(self._pool("prefill"), input_ids, check_room=False)
        try:
            decode = await self._route_in(self._pool("decode"), input_ids, exclude_decode)
        except BaseException:
            self.finish(prefill.worker_id, "prefill")
            raise
        if rid is not None:
            self._remember(rid, f"{prefill.worker_id}>{decode.worker_id}")
        return PairDecision(prefill, decode)

    def report_dead(self, worker_id: str, pool: str) -> None:
        """A caller saw `worker_id` die: purge it now and keep it out until the controller drops it."""
        p = self.pools.get(pool)
        if p is not None:
            self._purge(p, worker_id, "reported dead by a caller")
            membership.mark_dead(p.deployment_id, worker_id)

    def finish(self, worker_id: str, pool: str = "unified", timing: Optional[RequestTiming] = None) -> None:
        """The request left `worker_id`; `timing` (the ingress's TTFT / ITL) feeds the pool scaler, and the
        ingress totals once per request (the unified or prefill pool's finish: a disaggregated request
        finishes on both pools with the same timing)."""
        p = self.pools.get(pool)
        if p is not None:
            p.router.finish(worker_id)
        if timing is not None and pool != "decode":
            self._ingress.observe(timing)
        if self.scaler is not None:
            self.scaler.observe(pool, timing)

    def finish_many(self, finished: List[Finished]) -> List[None]:
        """`finish` for each, in order (one call for the finishes an ingress replica has waiting)."""
        for f in finished:
            self.finish(f.worker_id, f.pool, f.timing)
        return [None] * len(finished)

    # --- stored Responses API responses (cluster/ingress/response_store.py) ----------------------------

    def store_response(self, response_id: str, stored: StoredResponse) -> None:
        self.responses.put(response_id, stored)

    def stored_response(self, response_id: str) -> Optional[StoredResponse]:
        return self.responses.get(response_id)

    def delete_response(self, response_id: str) -> bool:
        return self.responses.delete(response_id)

    # --- admin API (cluster/ingress/admin.py → PoolScaler) ---------------------------------------------

    def _scaling(self) -> PoolScaler:
        if self.scaler is None:
            raise AdminError(503, "pool scaling is not configured in this application")
        return self.scaler

    def admin_status(self, history: bool = False) -> ClusterPools:
        return self._scaling().status(history)

    def admin_pool(self, pool: str, history: bool = False) -> PoolStatus:
        return self._scaling().pool_status(pool, history)

    async def admin_scale(self, pool: str, request: ScaleRequest) -> PoolStatus:
        return await self._scaling().scale(pool, request)

    def admin_drain(self, replica_id: str, remove: bool = False) -> ReplicaStatus:
        return self._scaling().drain(replica_id, remove)

    def admin_undrain(self, replica_id: str) -> ReplicaStatus:
        return self._scaling().undrain(replica_id)

    def decisions(self) -> Dict[str, str]:
        """rid → worker replica id (disaggregated: "prefill_id>decode_id") of the last 4096 routed
        requests that named a rid."""
        return dict(self._decisions)

    def stats(self) -> ClusterStats:
        views = {}
        for p in self.pools.values():
            self._sync_members(p)
            state = p.router.state
            for wid, s in state.stats().items():
                views[wid] = WorkerView(
                    pool=p.name,
                    tree_tokens=s.tree_tokens,
                    tree_nodes=s.tree_nodes,
                    routed_requests=s.routed_requests,
                    routed_tokens=s.routed_tokens,
                    matched_tokens=s.matched_tokens,
                    in_flight=s.in_flight,
                    capacity=state.workers[wid].capacity,
                    queue_len=s.queue_len,
                    kv_usage=s.kv_usage,
                    load=s.load,
                    events_applied=state.workers[wid].events_applied,
                    reported=p.reports.get(wid),
                )
        computing = [v for v in views.values() if v.pool != "decode"]
        engines = [v.reported.engine for v in computing if v.reported is not None]
        prompt = sum(e.prompt_tokens for e in engines)
        cached = sum(e.cached_tokens for e in engines)
        return ClusterStats(
            policy=self.policy,
            workers=views,
            routed_requests=sum(v.routed_requests for v in computing),
            cache_hit_rate=cached / prompt if prompt else 0.0,
            route_latency_ms=percentiles(self._latency_ms),
            membership_changes=self._membership_changes,
            purged_workers=list(self._purged),
            ingress=dict(self._ingress.sums),
        )

    def _pool(self, name: str) -> _Pool:
        p = self.pools.get(name)
        if p is None:
            raise NoWorkersError(f"this cluster has no {name} pool (pools: {', '.join(self.pools)})")
        return p

    async def _route_in(
        self, p: _Pool, input_ids: List[int], exclude: Sequence[str] = (), check_room: bool = True
    ) -> RoutingDecision:
        self._sync_members(p)
        if not p.router.state.workers:
            try:
                await asyncio.wait_for(p.ready.wait(), _MEMBERSHIP_WAIT_S)
            except asyncio.TimeoutError:
                raise NoWorkersError(f"no {p.name} worker replica is running") from None
            self._sync_members(p)
        start = time.perf_counter()
        decision = p.router.route(input_ids, exclude, check_room)
        self._latency_ms.append((time.perf_counter() - start) * 1e3)
        return decision

    def _remember(self, rid: str, where: str) -> None:
        self._decisions[rid] = where
        if len(self._decisions) > 4096:
            self._decisions.popitem(last=False)

    # --- membership and reports ----------------------------------------------------------------

    def _sync_members(self, p: _Pool) -> None:
        m = membership.members(p.deployment_id)
        if m.version == p.members_version:
            return
        p.members_version = m.version
        drained = self.scaler.excluded(p.name) if self.scaler is not None else set()
        change = p.router.state.sync_members(sorted(m.ids - m.dead - drained))
        self._record_change(p, change.added, change.removed)

    def _purge(self, p: _Pool, worker_id: str, why: str) -> None:
        if p.router.state.remove_worker(worker_id):
            self._record_change(p, [], [worker_id])
            logger.warning("router: purged %s worker %s (%s)", p.name, worker_id, why)

    def _record_change(self, p: _Pool, added: List[str], removed: List[str]) -> None:
        for w in removed:
            p.reports.pop(w, None)
            self._purged.append(w)
        if added or removed:
            self._membership_changes += 1
            logger.info("router: %s workers +%s -%s", p.name, added, removed)
        if p.router.state.workers:
            p.ready.set()
        else:
            p.ready.clear()

    async def _control_loop(self) -> None:
        while True:
            for p in self.pools.values():
                try:
                    self._sync_members(p)
                    await self._poll_reports(p)
                except Exception:  # noqa: BLE001 - the loop must survive anything
                    logger.exception("router: control loop iteration failed (%s pool)", p.name)
            if self.scaler is not None:
                try:
                    await self.scaler.step()
                except Exception:  # noqa: BLE001
                    logger.exception("router: pool scaler step failed")
            await asyncio.sleep(self.report_interval_s)

    async def _poll_reports(self, p: _Pool) -> None:
        ids = list(p.router.state.workers)
        results = await asyncio.gather(*(self._report(p, w) for w in ids), return_exceptions=True)
        for wid, res in zip(ids, results):
            if isinstance(res, ActorDiedError):
                self._purge(p, wid, f"report failed: {type(res).__name__}")
                membership.mark_dead(p.deployment_id, wid)  # out until the controller drops it too
            elif isinstance(res, BaseException):
                logger.debug("router: report from %s failed: %r", wid, res)
            elif res.replica_id in p.router.state:
                # res may come from another replica when the pinned one just left (fallback routing)
                s = res.stats
                p.router.state.on_report(res.replica_id, s.engine.waiting, s.engine.kv_usage, res.events, s.capacity)
                p.reports[res.replica_id] = s

    async def _report(self, p: _Pool, worker_id: str) -> "WorkerReport":
        call = p.handle.options(session_id=worker_id).report.remote()
        return await asyncio.wait_for(call, timeout=max(5.0, 10 * self.report_interval_s))
