"""Admin API, dashboard and per-pool Prometheus metrics, mounted on the ingress app.

    GET  /admin/pools[?history=true]          ClusterPools: every pool, its replicas and their states,
                                              queue, KV usage, cache hit rate, TTFT / ITL p90, tokens/s
    GET  /admin/pools/{pool}[?history=true]   PoolStatus
    POST /admin/pools/{pool}/scale            ScaleRequest: {"replicas": n} (fixed size) or
                                              {"autoscaling": true, "min_replicas": a, "max_replicas": b}
    POST /admin/replicas/{id}/drain           {"remove": false}: stop routing to it, let its requests finish
                                              (remove: then stop it and shrink the pool by one)
    POST /admin/replicas/{id}/undrain         route to it again
    GET  /dashboard/                          static page (HTML + JS + CSS of cluster/ingress/dashboard/, no build step,
                                              nothing from a CDN); it holds no data: every figure and every
                                              action goes through /admin/* with the admin key

Auth: every /admin route needs `Authorization: Bearer <admin_api_key>` and answers 401 otherwise;
the user API key is not accepted, and without an admin_api_key configured every admin route is 401.
The checks run as a router-level dependency, before the body is read.

Each call is one RPC to the router deployment, where the PoolScaler (cluster/scaling/loop.py) lives; its
AdminError keeps its HTTP status (404 unknown pool or replica, 409 conflicts, 400 bad bounds).
`PoolMetrics` exports the same figures at /metrics, labelled by pool (and replica), refreshed by a
small ASGI middleware before each /metrics scrape.
"""

import asyncio
import hmac
import pathlib
from typing import Any, Optional

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import FileResponse, RedirectResponse
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from ray.exceptions import RayTaskError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.scaling.models import AdminError, ClusterPools, DrainRequest, PoolStatus, ReplicaStatus, ScaleRequest
from serving.errors import APIError

DASHBOARD_DIR = pathlib.Path(__file__).parent / "dashboard"
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'"
)
_RPC_TIMEOUT_S = 30.0


def admin_key_check(admin_api_key: Optional[str]):
    """A FastAPI dependency: 401 unless `Authorization: Bearer <admin_api_key>` (never with no key set)."""
    expected = f"Bearer {admin_api_key}".encode() if admin_api_key else None

    async def check(authorization: Optional[str] = Header(None)) -> None:
        given = (authorization or "").encode()
        if expected is None or not hmac.compare_digest(given, expected):
            why = "no admin_api_key is configured" if expected is None else "invalid or missing admin key"
            raise HTTPException(
                401, f"{why} (send Authorization: Bearer <admin_api_key>)", headers={"WWW-Authenticate": "Bearer"}
            )

    return check


async def _call(method, *args) -> Any:
    try:
        return await asyncio.wait_for(method.remote(*args), _RPC_TIMEOUT_S)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, AdminError):
            raise APIError(cause.status, cause.message, None, "admin_error") from None
        raise


def admin_router(router_handle: Any, admin_api_key: Optional[str], metrics: "PoolMetrics") -> APIRouter:
    """The /admin routes over the router deployment's handle."""
    api = APIRouter(prefix="/admin", dependencies=[Depends(admin_key_check(admin_api_key))], tags=["admin"])

    @api.get("/pools", response_model=ClusterPools)
    async def pools(history: bool = False) -> ClusterPools:
        status = await _call(router_handle.admin_status, history)
        metrics.last = status
        return status

    @api.get("/pools/{pool}", response_model=PoolStatus)
    async def pool(pool: str, history: bool = False) -> PoolStatus:
        return await _call(router_handle.admin_pool, pool, history)

    @api.post("/pools/{pool}/scale", response_model=PoolStatus)
    async def scale(pool: str, body: ScaleRequest) -> PoolStatus:
        return await _call(router_handle.admin_scale, pool, body)

    @api.post("/replicas/{replica_id}/drain", response_model=ReplicaStatus)
    async def drain(replica_id: str, body: Optional[DrainRequest] = None) -> ReplicaStatus:
        return await _call(router_handle.admin_drain, replica_id, bool(body and body.remove))

    @api.post("/replicas/{replica_id}/undrain", response_model=ReplicaStatus)
    async def undrain(replica_id: str) -> ReplicaStatus:
        return await _call(router_handle.admin_undrain, replica_id)

    return api


def dashboard_router() -> APIRouter:
    """GET /dashboard (redirect) and /dashboard/{index.html, app.js, style.css}: static, no data."""
    api = APIRouter(tags=["dashboard"])
    headers = {"Cache-Control": "no-store", "Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}

    @api.get("/dashboard", include_in_schema=False)
    async def dashboard_root() -> RedirectResponse:
        return RedirectResponse("dashboard/", status_code=307)

    @api.get("/dashboard/", include_in_schema=False)
    async def dashboard_index() -> FileResponse:
        return FileResponse(DASHBOARD_DIR / "index.html", media_type=_FILES["index.html"], headers=headers)

    @api.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_file(name: str) -> FileResponse:
        if name not in _FILES:
            raise HTTPException(404, "not found")
        return FileResponse(DASHBOARD_DIR / name, media_type=_FILES[name], headers=headers)

    return api


class PoolMetrics:
    """Prometheus collector of the router's last ClusterPools: per-pool gauges and TTFT / ITL
    histograms (cluster-wide: the router sees every ingress replica's requests), and one
    radixserve_replica_state series per replica."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.last: Optional[ClusterPools] = None

    def describe(self):
        return []

    def collect(self):
        pools = self.last.pools if self.last is not None else []
        labels = ["model_name", "pool"]
        gauges = (
            ("target_replicas", "radixserve_pool_target_replicas", "Pool size the control loop wants."),
            ("ready_replicas", "radixserve_pool_ready_replicas", "Replicas the router hears from."),
            ("min_replicas", "radixserve_pool_min_replicas", "Autoscaling lower bound."),
            ("max_replicas", "radixserve_pool_max_replicas", "Autoscaling upper bound."),
            ("waiting", "radixserve_pool_num_requests_waiting", "Requests waiting in the pool's engines."),
            ("running", "radixserve_pool_num_requests_running", "Requests running in the pool's engines."),
            ("kv_usage", "radixserve_pool_kv_cache_usage_ratio", "Mean KV pool share in use."),
            ("cache_hit_rate", "radixserve_pool_prefix_cache_hit_rate", "Cached / prompt tokens."),
            ("tokens_per_s", "radixserve_pool_generation_tokens_per_second", "Tokens generated per second."),
        )
        for key, name, doc in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for p in pools:
                g.add_metric([self.model_name, p.name], float(getattr(p, key)))
            yield g
        auto = GaugeMetricFamily(
            "radixserve_pool_autoscaling", "1 when the pool autoscales, 0 when fixed.", labels=labels
        )
        state = GaugeMetricFamily(
            "radixserve_replica_state",
            "1 for the replica's current state.",
            labels=["model_name", "pool", "replica", "state"],
        )
        for p in pools:
            auto.add_metric([self.model_name, p.name], 1.0 if p.mode == "autoscaling" else 0.0)
            for r in p.replicas:
                state.add_metric([self.model_name, p.name, r.replica_id, r.state], 1.0)
        yield auto
        yield state
        for attr, name, doc in (
            (
                "ttft_histogram",
                "radixserve_pool_time_to_first_token_seconds",
                "Time to first token, by the pool that computed the prompt.",
            ),
            (
                "itl_histogram",
                "radixserve_pool_inter_token_latency_seconds",
                "Mean inter-token latency of each request, by the pool that decoded it.",
            ),
        ):
            h = HistogramMetricFamily(name, doc, labels=labels)
            for p in pools:
                view = getattr(p, attr)
                if view is not None:
                    h.add_metric([self.model_name, p.name], [(b, float(c)) for b, c in view.buckets], view.sum)
            yield h


class _RefreshOnScrape:
    """ASGI middleware: before GET /metrics, fetch the router's ClusterPools into PoolMetrics."""

    def __init__(self, app: ASGIApp, router_handle: Any, metrics: PoolMetrics):
        self.app, self.router, self.metrics = app, router_handle, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            try:
                self.metrics.last = await asyncio.wait_for(self.router.admin_status.remote(False), 10)
            except Exception:  # noqa: BLE001 - a stale or empty pool section beats a failed scrape
                pass
        await self.app(scope, receive, send)


def install_admin(app: FastAPI, router_handle: Any, admin_api_key: Optional[str], model_name: str) -> None:
    """Mount the admin API and the dashboard on `app`; register PoolMetrics on its registry."""
    metrics = PoolMetrics(model_name)
    app.state.serving.metrics.registry.register(metrics)
    app.include_router(admin_router(router_handle, admin_api_key, metrics))
    app.include_router(dashboard_router())
    app.add_middleware(_RefreshOnScrape, router_handle=router_handle, metrics=metrics)
