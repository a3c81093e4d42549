"""PoolScaler: the one control loop that owns pool sizes, run inside the router deployment.

    RouterDeployment._control_loop, every report_interval_s, after polling each pool's workers:
        PoolScaler.step()
          1. Serve's view (every 1 s): each pool deployment's replicas and their states, its target
          2. drains: poll excluded replicas (report()) until idle; remove or hand back
          3. per pool: PoolSignals (engine reports + TTFT / ITL windows) ─▶ PoolController.decide
          4. apply: a larger target is published at once; a smaller one first drains the replica
             Serve will stop (the newest routable one), then is published
          5. history: one PoolSample per pool per second (the dashboard's charts)
    admin API (cluster/ingress/admin.py, through RouterDeployment) ─▶ status / scale / drain / undrain

Drain, exactly: the replica leaves its pool's routing set at once (the router's membership sync
subtracts `excluded(pool)`, so no new request goes there; its approximate tree is dropped);
requests already on it run to the end; it is *drained* when its engine reports nothing running
or waiting twice in a row. Then, with `remove=True`, its actor is stopped (ray.kill; it is idle)
and, once Serve has dropped it, the pool's target is lowered by one, so that Serve stops the
replacement it began instead of keeping it. Without `remove`, a drained replica stays up,
excluded, until `undrain` puts it back (with an empty tree). Serve cannot be told which replica
to stop on a scale-down (it stops the newest on the least-loaded node), so scale-downs drain the
replica Serve is expected to stop (the newest routable one) before lowering the target; where
Serve stops another one, that one gets Serve's graceful shutdown and the drained one rejoins.

Single event loop (the router replica's): no locks.
"""

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Mapping, Optional, Protocol, Sequence, Set, Tuple

from cluster import membership
from cluster.latency import LatencyWindow, RequestTiming
from cluster.scaling.models import (
    AdminError,
    ClusterPools,
    HistogramView,
    PoolSample,
    PoolStatus,
    ReplicaStatus,
    ScaleRequest,
)
from cluster.scaling.policy import PoolController, PoolSignals, ScalingConfig, p90, publish_target
from cluster.workers.stats import WorkerStats

if TYPE_CHECKING:  # pragma: no cover - annotations only: this module imports no Ray at import time
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger("ray.serve")

HISTORY_LEN = 600
"""PoolSamples kept per pool (one a second: ten minutes)."""
SCALE_DOWN_DRAIN_TIMEOUT_S = 120.0
"""A scale-down proceeds after this long even if its victim still has requests."""
_SERVE_REFRESH_S = 1.0
_STARTING = {"STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"}


@dataclass
class _Drain:
    pool: str
    replica_id: str
    purpose: Literal["operator", "remove", "scale-down"]
    since: float
    phase: str = "draining"
    """draining → drained → (remove: removing) / (scale-down: stopping) → forgotten when Serve drops it."""
    phase_since: float = 0.0
    idle_polls: int = 0
    stats: Optional[WorkerStats] = None
    """The replica's last report while drained (the router no longer polls it)."""


class RoutedWorker(Protocol):
    """What the scaler reads of a worker the router routes to (the router's WorkerState)."""

    in_flight: int
    routed_requests: int


class ScaledPool(Protocol):
    """One pool as the router deployment hands it to the scaler: the pool's Serve handle and deployment id,
    the workers the router routes to and their last reports (read); a request to recompute the
    routing set, which subtracts `PoolScaler.excluded` (after a drain begins or ends)."""

    handle: "DeploymentHandle"
    """The pool's workers (a drained replica's report() is called through it, pinned by session_id)."""
    deployment_id: Any
    """Serve's DeploymentID of the pool (membership.members reads its live replicas)."""

    def routed_workers(self) -> Mapping[str, RoutedWorker]: ...

    def worker_stats(self) -> Mapping[str, WorkerStats]:
        """Worker id → its last report (workers that have reported)."""
        ...

    def resync_members(self) -> None: ...


class PoolScaler:
    """See the module docstring. `pools`: the router deployment's pools by name."""

    def __init__(self, config: ScalingConfig, pools: Dict[str, ScaledPool], app_name: str):
        self.config, self.pools, self.app = config, pools, app_name
        self.specs = {s.name: s for s in config.pools if s.name in pools}
        self.ctl = {name: PoolController(s) for name, s in self.specs.items()}
        self.applied: Dict[str, Optional[int]] = {name: None for name in self.specs}
        self.latency = {name: {"ttft": LatencyWindow(), "itl": LatencyWindow()} for name in self.specs}
        self.drains: Dict[str, _Drain] = {}
        self.history = {name: collections.deque(maxlen=HISTORY_LEN) for name in self.specs}
        self.serve_view: Dict[str, Dict[str, Any]] = {}
        """deployment → {"target": int, "replicas": {replica id: Serve state}}."""
        self._serve_at = 0.0
        self._tokens: Dict[str, Tuple[float, Dict[str, float]]] = {}
        self._tokens_per_s: Dict[str, float] = {name: 0.0 for name in self.specs}
        self._sample_at = 0.0

    @classmethod
    def in_replica(cls, config: ScalingConfig, pools: Dict[str, ScaledPool]) -> "PoolScaler":
        """The scaler of the Serve replica this runs in (its application's name from the replica context)."""
        from ray import serve

        return cls(config, pools, serve.get_replica_context().app_name)

    # --- inputs --------------------------------------------------------------------------------

    def excluded(self, pool: str) -> Set[str]:
        """Replica ids of `pool` the router must not route to."""
        return {d.replica_id for d in self.drains.values() if d.pool == pool}

    def observe(self, pool: str, timing: Optional[RequestTiming]) -> None:
        if timing is None or pool not in self.latency:
            return
        roles = self._latency_roles()
        if timing.ttft_ms is not None and pool == roles["ttft"]:
            self.latency[pool]["ttft"].observe(timing.ttft_ms)
        if timing.itl_ms is not None and pool == roles["itl"]:
            self.latency[pool]["itl"].observe(timing.itl_ms)

    def _latency_roles(self) -> Dict[str, str]:
        if "unified" in self.specs:
            return {"ttft": "unified", "itl": "unified"}
        return {"ttft": "prefill", "itl": "decode"}

    # --- the control step ----------------------------------------------------------------------

    async def step(self) -> None:
        now = time.monotonic()
        if now - self._serve_at >= _SERVE_REFRESH_S:
            self._serve_at = now
            await self._refresh_serve()
        for name in self.specs:
            await self._step_drains(name, now)
            decision = self.ctl[name].decide(self._signals(name, now), now)
            await self._apply(name, decision.target, now)
        if now - self._sample_at >= 1.0:
            self._sample_at = now
            for name in self.specs:
                self._sample(name, now)

    def _signals(self, name: str, now: float) -> PoolSignals:
        p = self.pools[name]
        reports = p.worker_stats()
        engines = [reports[w].engine if w in reports else None for w in p.routed_workers()]
        m = membership.members(p.deployment_id)
        lat = self.latency[name]
        return PoolSignals(
            ready=len(m.ids - m.dead),
            waiting=sum(e.waiting for e in engines if e is not None),
            running=sum(e.running for e in engines if e is not None),
            kv_usage=_mean([e.kv_usage if e is not None else 0.0 for e in engines]),  # unreported: 0
            ttft_p90_ms=p90(lat["ttft"].recent(now)),
            itl_p90_ms=p90(lat["itl"].recent(now)),
        )

    async def _apply(self, name: str, target: int, now: float) -> None:
        current = self.applied[name]
        if current is None or target > current:
            for d in [
                d
                for d in self.drains.values()
                if d.pool == name and d.purpose == "scale-down" and d.phase in ("draining", "drained")
            ]:
                self._forget(d)  # a pending scale-down is called off: back to routing
            await self._publish(name, target)
            return
        if target == current:
            return
        victim = next(
            (
                d
                for d in self.drains.values()
                if d.pool == name and d.purpose == "scale-down" and d.phase in ("draining", "drained")
            ),
            None,
        )
        if victim is None:
            routable = list(self.pools[name].routed_workers())
            if len(routable) <= 1:  # nothing left to route to: Serve will stop what it stops
                await self._publish(name, current - 1)
                return
            self._exclude(_Drain(name, routable[-1], "scale-down", now, phase_since=now))
            return
        if victim.phase == "drained" or now - victim.since > SCALE_DOWN_DRAIN_TIMEOUT_S:
            self._set_phase(victim, "stopping", now)
            await self._publish(name, current - 1)

    async def _publish(self, name: str, target: int) -> None:
        await asyncio.to_thread(publish_target, self.config.nonce, self.specs[name].deployment, target)
        if self.applied[name] != target:
            logger.info("scaler: %s pool target %s -> %d (%s)", name, self.applied[name], target, self.ctl[name].reason)
        self.applied[name] = target

    # --- drains --------------------------------------------------------------------------------

    def _exclude(self, d: _Drain) -> None:
        self.drains[d.replica_id] = d
        self.pools[d.pool].resync_members()  # the router recomputes its routing set at once
        logger.info("scaler: draining %s replica %s (%s)", d.pool, d.replica_id, d.purpose)

    def _forget(self, d: _Drain) -> None:
        self.drains.pop(d.replica_id, None)
        self.pools[d.pool].resync_members()

    def _set_phase(self, d: _Drain, phase: str, now: float) -> None:
        d.phase, d.phase_since = phase, now

    async def _step_drains(self, name: str, now: float) -> None:
        p = self.pools[name]
        live = membership.members(p.deployment_id).ids
        for d in [d for d in self.drains.values() if d.pool == name]:
            if d.replica_id not in live:
                if d.phase == "removing":
                    await self._after_removal(name)
                self._forget(d)  # Serve dropped it
                continue
            if d.phase == "stopping" and now - d.phase_since > 60:
                self._forget(d)  # Serve stopped another replica: this one serves again
                continue
            if d.phase in ("draining", "drained"):
                await self._poll_drain(p, d, now)
            if d.phase == "drained" and d.purpose == "remove":
                await self._kill(name, d.replica_id)
                self._set_phase(d, "removing", now)

    async def _poll_drain(self, p: Any, d: _Drain, now: float) -> None:
        try:
            report = await asyncio.wait_for(p.handle.options(session_id=d.replica_id).report.remote(), 5)
        except Exception:  # noqa: BLE001 - gone or busy: try again next step
            return
        if report.replica_id != d.replica_id:
            return  # answered by another replica (the pinned one just left)
        d.stats = report.stats
        idle = report.stats.engine.running == 0 and report.stats.engine.waiting == 0
        settle = max(1.0, 2 * self.config.report_interval_s)  # requests routed just before exclusion
        d.idle_polls = d.idle_polls + 1 if idle and now - d.since >= settle else 0
        if d.phase == "draining" and d.idle_polls >= 2:
            self._set_phase(d, "drained", now)
            logger.info("scaler: %s replica %s drained", d.pool, d.replica_id)

    async def _kill(self, name: str, replica_id: str) -> None:
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        actor_name = f"SERVE_REPLICA::{self.app}#{self.specs[name].deployment}#{replica_id}"
        try:
            ray.kill(await asyncio.to_thread(ray.get_actor, actor_name, namespace=SERVE_NAMESPACE), no_restart=True)
        except ValueError:
            pass  # already gone

    async def _after_removal(self, name: str) -> None:
        """A removed replica left: lower the pool's target by one (Serve then stops its replacement)."""
        ctl = self.ctl[name]
        if ctl.auto:
            ctl.target = max(ctl.min_replicas, ctl.target - 1)
            ctl.reason = "replica removed by an operator"
        else:
            ctl.set_replicas(max(1, ctl.target - 1))
        await self._publish(name, ctl.target)

    # --- Serve's view --------------------------------------------------------------------------

    async def _refresh_serve(self) -> None:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        try:
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            details = await asyncio.wait_for(controller.get_serve_instance_details.remote(), 5)
        except Exception as exc:  # noqa: BLE001 - status is best effort; scaling does not need it
            logger.debug("scaler: serve details failed: %r", exc)
            return
        deployments = (details.get("applications", {}).get(self.app) or {}).get("deployments", {})
        for spec in self.specs.values():
            dep = deployments.get(spec.deployment) or {}
            self.serve_view[spec.deployment] = {
                "target": dep.get("target_num_replicas"),
                "replicas": {
                    r["replica_id"]: str(getattr(r["state"], "value", r["state"])) for r in dep.get("replicas", [])
                },
            }

    # --- status, history and operator commands -------------------------------------------------

    def _replicas(self, name: str) -> List[ReplicaStatus]:
        p = self.pools[name]
        serve = self.serve_view.get(self.specs[name].deployment, {}).get("replicas", {})
        workers = p.routed_workers()
        m = membership.members(p.deployment_id)
        live = m.ids - m.dead
        ids = list(dict.fromkeys(list(workers) + sorted(live) + sorted(serve)))
        out = []
        for wid in ids:
            d = self.drains.get(wid)
            s = (d.stats if d is not None else None) or p.worker_stats().get(wid)
            e = s.engine if s is not None else None
            ws = workers.get(wid)
            sstate = serve.get(wid)
            if d is not None:
                label = d.phase
            elif sstate == "STOPPING":
                label = "stopping"
            elif ws is not None or wid in live:  # Serve broadcast it as running (its details may lag)
                label = "running"
            elif sstate in _STARTING:
                label = "starting"
            else:
                label = (sstate or "unknown").lower()
            out.append(
                ReplicaStatus(
                    replica_id=wid,
                    state=label,
                    serve_state=sstate,
                    routable=(ws is not None or wid in live) and d is None,
                    running=e.running if e else 0,
                    waiting=e.waiting if e else 0,
                    kv_usage=e.kv_usage if e else 0.0,
                    cache_hit_rate=e.cache_hit_rate if e else 0.0,
                    in_flight=ws.in_flight if ws else 0,
                    routed_requests=ws.routed_requests if ws else 0,
                    generated_tokens=e.generated_tokens if e else 0,
                    gpus=s.gpus if s else None,
                    tensor_parallel_size=s.tensor_parallel_size if s else None,
                )
            )
        return out

    def _generated(self, name: str) -> Dict[str, float]:
        """Worker id → tokens it generated since it started (workers that have reported)."""
        return {w: s.engine.generated_tokens for w, s in self.pools[name].worker_stats().items()}

    def _hit_rate(self, name: str) -> float:
        """Cached / prompt tokens over the pool's reported workers (0 before the first prompt)."""
        engines = [s.engine for s in self.pools[name].worker_stats().values()]
        prompt = sum(e.prompt_tokens for e in engines)
        cached = sum(e.cached_tokens for e in engines)
        return cached / prompt if prompt else 0.0

    def _sample(self, name: str, now: float) -> None:
        gen = self._generated(name)
        prev = self._tokens.get(name)
        if prev is not None and now > prev[0]:
            delta = sum(max(0.0, v - prev[1].get(w, v)) for w, v in gen.items())
            self._tokens_per_s[name] = delta / (now - prev[0])
        self._tokens[name] = (now, gen)
        s = self._signals(name, now)
        self.history[name].append(
            PoolSample(
                time=time.time(),
                replicas=s.ready,
                target=self.ctl[name].target,
                waiting=s.waiting,
                running=s.running,
                kv_usage=s.kv_usage,
                cache_hit_rate=self._hit_rate(name),
                ttft_p90_ms=s.ttft_p90_ms,
                itl_p90_ms=s.itl_p90_ms,
                tokens_per_s=self._tokens_per_s[name],
            )
        )

    def pool_status(self, name: str, history: bool = False) -> PoolStatus:
        if name not in self.specs:
            raise AdminError(404, f"no pool named {name!r} (pools: {', '.join(self.specs)})")
        ctl, now = self.ctl[name], time.monotonic()
        s = self._signals(name, now)
        lat = self.latency[name]
        roles = self._latency_roles()

        def hist(kind: str) -> Optional[HistogramView]:
            if roles[kind] != name:
                return None
            h = lat[kind].histogram
            return HistogramView(buckets=h.cumulative(), sum=h.total, count=h.count)

        return PoolStatus(
            name=name,
            deployment=self.specs[name].deployment,
            mode="autoscaling" if ctl.auto else "manual",
            target_replicas=ctl.target,
            serve_target_replicas=self.serve_view.get(self.specs[name].deployment, {}).get("target"),
            min_replicas=ctl.min_replicas,
            max_replicas=ctl.max_replicas,
            autoscaling=ctl.settings.model_dump(),
            last_decision=ctl.reason,
            ready_replicas=s.ready,
            replicas=self._replicas(name),
            waiting=s.waiting,
            running=s.running,
            kv_usage=s.kv_usage,
            cache_hit_rate=self._hit_rate(name),
            ttft_p90_ms=s.ttft_p90_ms,
            itl_p90_ms=s.itl_p90_ms,
            tokens_per_s=self._tokens_per_s[name],
            ttft_histogram=hist("ttft"),
            itl_histogram=hist("itl"),
            history=list(self.history[name]) if history else [],
        )

    def status(self, history: bool = False) -> ClusterPools:
        return ClusterPools(time=time.time(), pools=[self.pool_status(n, history) for n in self.specs])

    async def scale(self, name: str, req: ScaleRequest) -> PoolStatus:
        if name not in self.specs:
            raise AdminError(404, f"no pool named {name!r} (pools: {', '.join(self.specs)})")
        ctl = self.ctl[name]
        if req.replicas is not None:
            ctl.set_replicas(req.replicas)
        elif req.autoscaling is False:
            ctl.set_replicas(ctl.target)
        else:
            try:
                ctl.set_autoscaling(req.min_replicas, req.max_replicas)
            except ValueError as exc:
                raise AdminError(400, str(exc)) from None
        await self._apply(name, ctl.target, time.monotonic())
        return self.pool_status(name)

    def _find(self, replica_id: str) -> str:
        for name, p in self.pools.items():
            if name in self.specs and (
                replica_id in membership.members(p.deployment_id).ids or replica_id in p.routed_workers()
            ):
                return name
        raise AdminError(404, f"no live worker replica {replica_id!r}")

    def drain(self, replica_id: str, remove: bool = False) -> ReplicaStatus:
        name = self._find(replica_id)
        ctl = self.ctl[name]
        if remove and ctl.target <= (ctl.min_replicas if ctl.auto else 1):
            raise AdminError(409, f"the {name} pool is at its minimum size; raise it or drain without remove")
        d = self.drains.get(replica_id)
        if d is None:
            others = [w for w in self.pools[name].routed_workers() if w != replica_id]
            if not others:
                raise AdminError(409, f"{replica_id} is the last routable replica of the {name} pool")
            now = time.monotonic()
            self._exclude(_Drain(name, replica_id, "remove" if remove else "operator", now, phase_since=now))
        elif remove and d.purpose == "operator":
            d.purpose = "remove"
        return next(r for r in self._replicas(name) if r.replica_id == replica_id)

    def undrain(self, replica_id: str) -> ReplicaStatus:
        d = self.drains.get(replica_id)
        if d is None:
            self._find(replica_id)  # 404 for a replica that does not exist
        if d is None or d.phase in ("removing", "stopping"):
            raise AdminError(409, f"{replica_id} is not draining (or is being stopped)")
        self._forget(d)
        return next(r for r in self._replicas(d.pool) if r.replica_id == replica_id)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
