"""Ingress: the HTTP front of the cluster — serving's OpenAI app over a ClusterBackend.

    HTTP ─▶ serving.build_app routes (validate, chat template, tokenize ONCE)
         ─▶ ClusterBackend.generate_stream(input_ids, params, rid)
              1. Router.route(input_ids, rid) ─▶ RoutingDecision (one small RPC)
              2. Worker.generate, pinned to decision.worker_id (session_id + PinnedRequestRouter),
                 streamed: one Ray message per engine step of token ids, unpacked into StreamOutputs
                 and detokenized here, stop strings included (cluster/text.py)
              3. Router.finish(worker_id) when the stream ends, fails or is cancelled
    GET /router/stats ─▶ Router.stats() (+ this replica's route-RPC latency)
    GET /metrics      ─▶ serving metrics of this replica + per-worker gauges labelled by replica

Aborts: serving closes the backend stream on client disconnect; closing it cancels the Ray
generator, Serve cancels the worker's generator, and the engine aborts the request. Ingress
replicas hold no routing state (it lives in the router deployment), so they scale freely.
"""
import asyncio
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import FastAPI
from prometheus_client.core import GaugeMetricFamily
from ray import serve
from ray.exceptions import RayTaskError

from cluster.latency import IngressLatency, RequestClock
from cluster.router.policies import NoWorkersError
from cluster.text import OutputText
from serving.backend import ServingBackend
from serving.errors import APIError

_RPC_TIMEOUT_S = 120.0

STREAM_OPTIONS = {"stream": True, "_by_reference": False}
"""Handle options of the token streams from workers. `_by_reference=False` sends each message over
Serve's gRPC transport instead of through the object store: about twice the messages per second
(RAY_SERVE_NOTES §3), and a worker sends one message per running request per engine step. On one
H100 (Llama-3.1-8B dummy weights, 64 requests in flight: ~3.4k messages/s) the cluster went from
0.44× of the bare engine's throughput to 0.84× with this, and to 0.92× with Serve's Python HTTP proxy's
handle to the ingress on gRPC as well (RAY_SERVE_USE_GRPC_BY_DEFAULT=1, which deploy/serve.sh and the
image set; benchmarks/bench_overhead.py). They also put HAProxy in front (RAY_SERVE_ENABLE_HA_PROXY=1),
which sends HTTP straight to an ingress replica: no Serve hop before the ingress at all."""


async def _awaited(call: Any) -> Any:
    """The result of a DeploymentResponse, as a coroutine (so that it can run as a task)."""
    return await call


def _unwrap(exc: BaseException) -> BaseException:
    """The exception raised inside a replica (engine errors keep their type and message)."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


class ClusterBackend(ServingBackend):
    """A ServingBackend whose requests run on the worker the router chose."""

    def __init__(self, router, workers, tokenizer: Any, context_len: int, vocab_size: int):
        self.router, self.workers = router, workers
        self.tokenizer, self.context_len, self._vocab_size = tokenizer, context_len, vocab_size
        self._active: Dict[str, Any] = {}
        self._sent: set = set()
        """Calls in flight that nobody awaits (router.finish, a choice's abort)."""
        self.latency = IngressLatency()
        """This replica's routing-call and call → first message times (GET /router/stats, "ingress")."""
        self.last_stats: Optional[Any] = None
        """The last ClusterStats fetched (for the per-worker metrics collector)."""

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    async def _ask_router(self, call, finish: Callable[[Any], None]) -> Any:
        """Await a routing call (bounded); its time goes to self.latency; no worker → HTTP 503.

        The router counts the request in flight as soon as it decides. If this caller gives up first
        (client disconnect: cancelled; or the bound ran out), the decision may still come: `finish(decision)`
        then runs when it does, so the router does not count a request that never ran."""
        start = time.perf_counter()
        task = asyncio.ensure_future(_awaited(call))
        try:
            decision = await asyncio.wait_for(asyncio.shield(task), _RPC_TIMEOUT_S)
        except BaseException as exc:
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or finish(t.result()))
            if not isinstance(exc, Exception):
                raise
            exc = _unwrap(exc)
            if isinstance(exc, NoWorkersError):
                raise APIError(503, f"no worker replica is available: {exc}", None, "no_workers") from None
            raise exc
        self.latency.on_route((time.perf_counter() - start) * 1e3)
        return decision

    async def generate_stream(self, input_ids: List[int], params: Any, rid: str) -> AsyncIterator[Any]:
        text = OutputText(self.tokenizer, input_ids, params)  # before routing: nothing to finish if it raises
        decision = await self._ask_router(self.router.route.remote(input_ids, rid),
                                          lambda late: self._finish(late.worker_id))
        gen = self.workers.options(session_id=decision.worker_id, **STREAM_OPTIONS).generate.remote(
            input_ids, params, rid)
        self._active[rid] = gen
        clock = RequestClock()  # the worker call → first message (the routing call is timed apart)
        try:
            async for chunk in gen:
                clock.on_chunk(chunk)
                for out in self._with_text(text, chunk, decision.worker_id, rid, params.n):
                    yield out
                if text.finished:
                    return  # the last choice stopped here: closing the stream aborts it on the worker
        except RayTaskError as exc:
            raise _unwrap(exc) from None
        finally:
            try:
                if self._active.pop(rid, None) is not None:
                    gen.cancel()
            finally:  # the router hears of the end even if cancelling raised (serving's close swallows it)
                self.latency.on_request(clock)
                self._finish(decision.worker_id, timing=clock.timing())

    def _with_text(self, text: OutputText, chunk: List[Any], worker_id: str, rid: str, n: int) -> List[Any]:
        """The worker's outputs with their text (OutputText); a choice of several that a stop string ended
        here is aborted on the worker (a lone choice ends with the stream)."""
        outs = []
        for raw in chunk:
            out = text.apply(raw)
            if out is None:
                continue
            outs.append(out)
            if n > 1 and text.stopped_here(out) and not text.finished:
                self._abort_choice(worker_id, f"{rid}#{out.index}")
        return outs

    def _abort_choice(self, worker_id: str, engine_rid: str) -> None:
        self._send(self.workers.options(session_id=worker_id).abort.remote(engine_rid))

    def _finish(self, worker_id: str, timing: Any = None) -> None:
        self._send(self.router.finish.remote(worker_id, timing=timing))

    def _send(self, call: Any) -> None:
        """Let a call run without awaiting its answer (referenced until it completes)."""
        task = asyncio.ensure_future(call)
        self._sent.add(task)
        task.add_done_callback(self._sent.discard)

    def abort(self, rid: str) -> None:
        gen = self._active.pop(rid, None)
        if gen is not None:
            gen.cancel()

    async def cluster_stats(self) -> Any:
        self.last_stats = await asyncio.wait_for(self.router.stats.remote(), 30)
        return self.last_stats

    async def stats(self) -> Dict[str, float]:
        s = await self.cluster_stats()
        engines = [w.engine for w in s.workers.values()]
        kv = [e.get("kv_usage", 0.0) for e in engines]
        return dict(running=sum(e.get("running", 0) for e in engines),
                    waiting=sum(e.get("waiting", 0) for e in engines),
                    kv_usage=sum(kv) / len(kv) if kv else 0.0, cache_hit_rate=s.cache_hit_rate)

    async def health(self) -> bool:
        try:
            return bool((await self.cluster_stats()).workers)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False


class WorkerGauges:
    """Prometheus collector: per-worker gauges from the backend's last ClusterStats (refreshed at
    each /metrics scrape before rendering), labelled by pool and replica."""

    _GAUGES = (("running", "radixserve_worker_num_requests_running", "Requests in the worker's running batch."),
               ("waiting", "radixserve_worker_num_requests_waiting", "Requests in the worker's waiting queue."),
               ("kv_usage", "radixserve_worker_kv_cache_usage_ratio", "Worker KV pool share held by requests."),
               ("cache_hit_rate", "radixserve_worker_prefix_cache_hit_rate", "Worker cached / prompt tokens."),
               ("prompt_tokens", "radixserve_worker_prompt_tokens", "Prompt tokens the worker processed."),
               ("cached_tokens", "radixserve_worker_cached_prompt_tokens", "Prompt tokens served from its cache."),
               ("generated_tokens", "radixserve_worker_generation_tokens", "Tokens the worker generated."))
    _ROUTER = (("routed_requests", "radixserve_router_routed_requests", "Requests the router sent to the worker."),
               ("matched_tokens", "radixserve_router_matched_tokens", "Prompt tokens the router's tree held."),
               ("tree_tokens", "radixserve_router_tree_tokens", "Tokens in the router's tree of the worker."),
               ("in_flight", "radixserve_router_in_flight_requests", "Requests routed and not finished."))

    def __init__(self, backend: ClusterBackend, model_name: str):
        self.backend, self.model_name = backend, model_name

    def describe(self):
        return []

    def collect(self):
        s = self.backend.last_stats
        labels = ["model_name", "pool", "replica"]
        families = []
        for key, name, doc in self._GAUGES + self._ROUTER:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for wid, w in (s.workers.items() if s is not None else ()):
                value = w.engine.get(key, 0.0) if (key, name, doc) in self._GAUGES else getattr(w, key)
                g.add_metric([self.model_name, w.pool, wid], float(value))
            families.append(g)
        lat = GaugeMetricFamily("radixserve_router_decision_latency_ms", "Routing decision time in the router.",
                                labels=["quantile"])
        for q in ("p50", "p99"):
            lat.add_metric([q], float(s.route_latency_ms.get(q, 0.0)) if s is not None else 0.0)
        families.append(lat)
        return families


@serve.ingress()
class Ingress:
    """The HTTP entry point; routes come from serving.build_app (no protocol code here)."""

    async def __init__(self, router, workers, model: Optional[str], model_name: str,
                   api_key: Optional[str], max_body_bytes: int, admin_api_key: Optional[str] = None,
                   mode: str = "unified", tokenizer_source: Optional[str] = None, prefill=None):
        """`workers`: the unified pool's handle, or the decode pool's (mode="disaggregated"); `prefill`: the
        prefill pool's handle when the ingress starts prompts there (disaggregated, early_prefill)."""
        from engine.models.source import resolve_model
        from engine.tokenizer import load_tokenizer

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.admin_api_key = admin_api_key
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(tokenizer_source or model))
        info = await asyncio.wait_for(workers.info.remote(), 600)  # waits for a first worker to be up
        if mode == "disaggregated":
            from cluster.disaggregated import DisaggregatedBackend

            self.backend = DisaggregatedBackend(router, workers, tokenizer, info.context_len, info.vocab_size,
                                                prefill=prefill)
        else:
            self.backend = ClusterBackend(router, workers, tokenizer, info.context_len, info.vocab_size)

    def __serve_build_asgi_app__(self) -> FastAPI:
        from cluster.admin import install_admin
        from serving.app import build_app

        app = build_app(self.backend, api_key=self.api_key, model_name=self.model_name,
                        max_body_bytes=self.max_body_bytes, title="radixserve cluster")
        app.state.serving.metrics.registry.register(WorkerGauges(self.backend, self.model_name))
        install_admin(app, self.backend.router, self.admin_api_key, self.model_name)  # /admin, /dashboard
        backend, replica_id = self.backend, self.replica_id

        @app.get("/router/stats")
        async def router_stats() -> Dict[str, Any]:
            s = await backend.cluster_stats()
            out = s.model_dump()
            out["ingress"] = {"replica": replica_id, **backend.latency.snapshot()}
            return out

        return app
