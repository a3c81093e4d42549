"""Pool sizing: the decision (PoolController) and how it reaches Ray Serve (FollowPoolTarget).

    RouterDeployment control loop (cluster/scaling/loop.py, PoolScaler.step)
        PoolSignals (waiting, KV usage, TTFT / ITL p90, ready replicas) ─▶ PoolController.decide
        operator settings (admin API: replicas, or autoscaling bounds)  ─▶ PoolController
        target ─▶ publish_target(nonce, deployment, n)      (Ray's internal KV, namespace "radixserve")
    Serve controller, every control-loop tick, per pool deployment:
        FollowPoolTarget(ctx) reads that key ─▶ the deployment's target replica count

Why this path, and not the external scaler API: `serve run cluster.app:deployment` calls
`serve.run(app)` without `external_scaler_enabled`, and both the REST scale endpoint and the
controller's `update_deployment_replicas` refuse to act without it (docs/design.md; checked in
ray 2.60 `serve/scripts.py` and `_private/controller.py`). A deployment-level custom autoscaling
policy works for `serve run`, `serve deploy`, the YAML config and KubeRay alike, changes only its own
deployment (no restarts elsewhere), and Serve stays the one that starts and stops replicas. The policy
is a thin follower: the decision itself lives in the application (PoolController), where the LLM
signals (engine reports, TTFT / ITL from the ingress) and the operator's settings already are.

The key carries a per-build nonce (`ScalingConfig.nonce`), so a redeployed application never
follows a target left in the KV store by an earlier one; until the first publish, the policy keeps
Serve's current target (the pool's initial size).

No heavy imports here: the Serve controller unpickles FollowPoolTarget and imports this module.
"""

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from pydantic import BaseModel, Field

KV_NAMESPACE = "radixserve"
REPLICA_CAP = 64
"""Most replicas of one pool (the Serve deployment's max_replicas; larger requests get a 400)."""
_READ_PERIOD_S = 0.2
"""FollowPoolTarget reads the KV store at most this often (the controller ticks every 0.1 s)."""

POOL_DEPLOYMENTS = {"unified": "Worker", "prefill": "Prefill", "decode": "Decode"}
"""Pool name → its Serve deployment's name."""


class PoolSpec(BaseModel):
    """One worker pool as the builder configured it."""

    name: str = Field(description="unified, prefill or decode.")
    deployment: str = Field(description="The pool's Serve deployment name.")
    initial_replicas: int = Field(ge=1)
    autoscaling: Optional[Dict[str, Any]] = Field(
        None, description="cluster.config.PoolAutoscaling fields, or None: fixed size until an operator changes it."
    )


class ScalingConfig(BaseModel):
    """What the router deployment's PoolScaler needs (built once per application build)."""

    nonce: str = Field(description="Unique per build: names this application's KV keys.")
    pools: List[PoolSpec]
    report_interval_s: float = 0.5


def scaling_config(args: Any) -> ScalingConfig:
    """ScalingConfig of validated ClusterArgs (one PoolSpec per pool of its mode)."""
    pools = []
    for name, n in args.pool_sizes().items():
        auto = args.pool_autoscaling(name)
        pools.append(
            PoolSpec(
                name=name,
                deployment=POOL_DEPLOYMENTS[name],
                initial_replicas=n,
                autoscaling=auto.model_dump() if auto is not None else None,
            )
        )
    return ScalingConfig(nonce=uuid.uuid4().hex[:16], pools=pools, report_interval_s=args.report_interval_s)


def deployment_options(config: ScalingConfig, pool: str) -> Dict[str, Any]:
    """Serve deployment options of `pool`: an autoscaling_config whose policy follows the app's
    target. Use instead of `num_replicas` (Serve rejects both together)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    spec = next(p for p in config.pools if p.name == pool)
    return {
        "autoscaling_config": AutoscalingConfig(
            min_replicas=1,
            max_replicas=REPLICA_CAP,
            initial_replicas=spec.initial_replicas,
            upscale_delay_s=0.0,
            downscale_delay_s=0.0,  # PoolController does the hysteresis
            policy=AutoscalingPolicy(policy_function=FollowPoolTarget, policy_kwargs={"nonce": config.nonce}),
        )
    }


def target_key(nonce: str, deployment: str) -> bytes:
    return f"pool_target/{nonce}/{deployment}".encode()


def publish_target(nonce: str, deployment: str, target: int) -> None:
    """Store the target (blocking GCS call: run it in a thread from async code)."""
    from ray.experimental.internal_kv import _internal_kv_put

    body = json.dumps({"target": int(target), "time": time.time()}).encode()
    _internal_kv_put(target_key(nonce, deployment), body, overwrite=True, namespace=KV_NAMESPACE)


def read_target(nonce: str, deployment: str) -> Optional[int]:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(target_key(nonce, deployment), namespace=KV_NAMESPACE)
    return None if raw is None else int(json.loads(raw)["target"])


class FollowPoolTarget:
    """Serve autoscaling policy (class form, instantiated once per deployment in the controller):
    returns the target the application published, or Serve's current target before the first."""

    def __init__(self, nonce: str):
        self.nonce = nonce
        self._target: Optional[int] = None
        self._read_at = 0.0

    def __call__(self, ctx) -> Tuple[int, Dict[str, Any]]:
        now = time.monotonic()
        if now - self._read_at >= _READ_PERIOD_S:
            self._read_at = now
            try:
                self._target = read_target(self.nonce, ctx.deployment_name)
            except Exception:  # noqa: BLE001 - a GCS hiccup keeps the last known target
                pass
        target = ctx.target_num_replicas if self._target is None else self._target
        return target, ctx.policy_state


@dataclass(frozen=True)
class PoolSignals:
    """One pool's load, as the router saw it at one control-loop step."""

    ready: int
    """Replicas the router hears from (running, routable or draining)."""
    waiting: int
    """Requests waiting in the routable replicas' engine queues."""
    running: int
    kv_usage: float
    """Mean KV-pool share in use over routable replicas, in [0, 1]."""
    ttft_p90_ms: Optional[float] = None
    """Recent p90 time to first token (None: no recent sample, or not this pool's signal)."""
    itl_p90_ms: Optional[float] = None


@dataclass
class Decision:
    target: int
    reason: str


class PoolController:
    """The target size of one pool: the operator's fixed count (manual mode), or autoscaling within
    [min_replicas, max_replicas] on LLM signals.

    Autoscaling: the pool is *hot* when waiting requests per ready replica exceed
    target_waiting_per_replica, mean KV usage exceeds target_kv_usage, p90 TTFT exceeds
    ttft_target_ms or p90 ITL exceeds itl_target_ms. It is *cold* when nothing waits, KV usage is
    under half its target and every latency with a target is under half of it. Hot for
    upscale_delay_s adds one replica (not while earlier new replicas are still starting); cold for
    downscale_delay_s removes one. Each step restarts its timer.
    """

    def __init__(self, spec: PoolSpec):
        from cluster.config import PoolAutoscaling

        self.name = spec.name
        self.auto = spec.autoscaling is not None
        self.settings = PoolAutoscaling.model_validate(spec.autoscaling or {})
        if not self.auto:  # bounds an operator gets when switching autoscaling on later
            self.settings = self.settings.model_copy(
                update={"min_replicas": 1, "max_replicas": max(4, spec.initial_replicas)}
            )
        self.target = self._clamp(spec.initial_replicas) if self.auto else spec.initial_replicas
        self.reason = "initial size"
        self._hot_since: Optional[float] = None
        self._cold_since: Optional[float] = None

    @property
    def min_replicas(self) -> int:
        return self.settings.min_replicas

    @property
    def max_replicas(self) -> int:
        return self.settings.max_replicas

    def set_replicas(self, n: int) -> None:
        """Manual mode: the pool keeps exactly `n` replicas until autoscaling is switched on again."""
        self.auto, self.target, self.reason = False, n, f"operator set {n} replicas"

    def set_autoscaling(self, min_replicas: Optional[int] = None, max_replicas: Optional[int] = None) -> None:
        """Autoscaling mode with new bounds (unset: keep the current ones); the target is clamped at once.
        Raises ValueError when min > max."""
        lo = self.min_replicas if min_replicas is None else min_replicas
        hi = self.max_replicas if max_replicas is None else max_replicas
        if lo > hi:
            raise ValueError(f"min_replicas ({lo}) > max_replicas ({hi})")
        self.settings = self.settings.model_copy(update={"min_replicas": lo, "max_replicas": hi})
        self.auto = True
        clamped = self._clamp(self.target)
        self.reason = f"operator set autoscaling bounds [{lo}, {hi}]"
        self.target, self._hot_since, self._cold_since = clamped, None, None

    def decide(self, s: PoolSignals, now: float) -> Decision:
        if not self.auto:
            return Decision(self.target, self.reason)
        hot, cold = self._hot(s), self._cold(s)
        self._hot_since = (now if self._hot_since is None else self._hot_since) if hot else None
        self._cold_since = (now if self._cold_since is None else self._cold_since) if cold else None
        c = self.settings
        if (
            hot
            and self.target < c.max_replicas
            and s.ready >= self.target
            and now - self._hot_since >= c.upscale_delay_s
        ):
            self.target, self.reason, self._hot_since = self.target + 1, f"scale up: {hot}", now
        elif cold and self.target > c.min_replicas and now - self._cold_since >= c.downscale_delay_s:
            self.target, self.reason, self._cold_since = self.target - 1, "scale down: idle", now
        return Decision(self.target, self.reason)

    def _hot(self, s: PoolSignals) -> str:
        """Why the pool is hot ("" when it is not)."""
        c = self.settings
        if s.waiting / max(1, s.ready) > c.target_waiting_per_replica:
            return f"{s.waiting} waiting on {s.ready} replica(s)"
        if s.kv_usage > c.target_kv_usage:
            return f"KV usage {s.kv_usage:.2f}"
        if c.ttft_target_ms and s.ttft_p90_ms is not None and s.ttft_p90_ms > c.ttft_target_ms:
            return f"TTFT p90 {s.ttft_p90_ms:.0f} ms"
        if c.itl_target_ms and s.itl_p90_ms is not None and s.itl_p90_ms > c.itl_target_ms:
            return f"ITL p90 {s.itl_p90_ms:.0f} ms"
        return ""

    def _cold(self, s: PoolSignals) -> bool:
        c = self.settings
        if s.waiting > 0 or s.kv_usage >= c.target_kv_usage / 2:
            return False
        for value, target in ((s.ttft_p90_ms, c.ttft_target_ms), (s.itl_p90_ms, c.itl_target_ms)):
            if target and value is not None and value >= target / 2:
                return False
        return True

    def _clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


def p90(values: List[float]) -> Optional[float]:
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
