"""Ingress: the HTTP front of the cluster — serving's OpenAI app over a ClusterBackend (or, in mode=disaggregated,
a DisaggregatedBackend), the admin API and dashboard, /router/stats and the per-worker gauges."""

import asyncio
from typing import Any, Dict, Optional

from fastapi import FastAPI
from ray import serve

from cluster.ingress.backend import ClusterBackend
from cluster.ingress.disaggregated import DisaggregatedBackend
from cluster.ingress.metrics import WorkerGauges
from cluster.ingress.response_store import RouterResponseStore
from serving.response_store import StoreLimits


@serve.ingress()
class Ingress:
    """The HTTP entry point; routes come from serving.build_app (no protocol code here)."""

    async def __init__(
        self,
        router,
        workers,
        model: Optional[str],
        model_name: str,
        api_key: Optional[str],
        max_body_bytes: int,
        admin_api_key: Optional[str] = None,
        request_timeout_s: Optional[float] = None,
        rate_limits: Any = None,
        cors_origins: Optional[str] = None,
        response_store: StoreLimits = StoreLimits(),
        mode: str = "unified",
        tokenizer_source: Optional[str] = None,
        prefill=None,
    ):
        """`workers`: the unified pool's handle, or the decode pool's (mode="disaggregated"); `prefill`: the
        prefill pool's handle when the ingress starts prompts there (disaggregated, early_prefill)."""
        from engine.models.source import resolve_model
        from engine.tokenizer import load_tokenizer

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.admin_api_key, self.request_timeout_s = admin_api_key, request_timeout_s
        self.rate_limits = rate_limits
        """serving.ratelimit.RateLimits of this replica (its share of the cluster's), or None."""
        self.cors_origins = cors_origins
        """ClusterArgs.cors_origins (comma-separated; None: CORS off)."""
        self.response_store_enabled = response_store.enabled
        """False: the router deployment keeps no responses (ClusterArgs.response_store_* of 0)."""
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(tokenizer_source or model))
        info = await asyncio.wait_for(workers.info.remote(), 600)  # waits for a first worker to be up
        if mode == "disaggregated":
            self.backend = DisaggregatedBackend(
                router, workers, tokenizer, info.context_len, info.vocab_size, prefill=prefill
            )
        else:
            self.backend = ClusterBackend(router, workers, tokenizer, info.context_len, info.vocab_size)

    def __del__(self) -> None:
        """Serve calls it once this replica has drained (its HTTP requests are over): the streams from the
        workers end here, so that workers stopping with it need not wait for them."""
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()

    async def drain(self, grace_s: float) -> int:
        """Stop admitting (503 + Retry-After, /health 503) and wait until this replica's requests are over:
        those still running after `grace_s` end with a `shutting_down` error event and [DONE]. Returns
        how many requests were running when the drain began (cluster/shutdown.py calls it on SIGTERM)."""
        running = self.lifetimes.active
        self.lifetimes.drain(grace_s)
        await asyncio.wait_for(self.lifetimes.idle(), grace_s + 10)
        return running

    def __serve_build_asgi_app__(self) -> FastAPI:
        from fastapi import Depends

        from cluster.ingress.admin import admin_key_check, install_admin
        from serving.app import build_app, parse_origins

        # The admin API checks the admin key itself; the dashboard's files hold no data (its page asks
        # for the admin key). /router/stats (replica ids, KV usage, queues) needs the admin key when one
        # is set, else the API key.
        own_auth = ("/admin", "/dashboard") + (("/router/",) if self.admin_api_key else ())

        app = build_app(
            self.backend,
            api_key=self.api_key,
            model_name=self.model_name,
            max_body_bytes=self.max_body_bytes,
            title="radixserve cluster",
            own_auth_prefixes=own_auth,
            # one store for every ingress replica
            response_store=RouterResponseStore(self.backend.router, self.response_store_enabled),
            request_timeout_s=self.request_timeout_s,
            rate_limits=self.rate_limits,
            cors_origins=parse_origins(self.cors_origins),
        )
        self.lifetimes = app.state.serving.lifetimes
        app.state.serving.metrics.registry.register(WorkerGauges(self.backend, self.model_name))
        install_admin(app, self.backend.router, self.admin_api_key, self.model_name)  # /admin, /dashboard
        backend, replica_id = self.backend, self.replica_id

        stats_auth = [Depends(admin_key_check(self.admin_api_key))] if self.admin_api_key else []

        @app.get("/router/stats", dependencies=stats_auth)
        async def router_stats() -> Dict[str, Any]:
            s = await backend.cluster_stats()
            out = s.model_dump()
            out["ingress_replica"] = {"replica": replica_id, **backend.latency.snapshot()}
            return out

        return app
