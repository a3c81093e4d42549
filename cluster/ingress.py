"""Ingress: the HTTP front of the cluster — serving's OpenAI app over a ClusterBackend.

    HTTP ─▶ serving.build_app routes (validate, chat template, tokenize ONCE)
         ─▶ ClusterBackend.generate_stream(input_ids, params, rid)
              1. Router.route(input_ids, rid) ─▶ RoutingDecision (one small RPC)
              2. Worker.submit(input_ids, params, rid, ...), pinned to decision.worker_id (session_id +
                 PinnedRequestRouter); the outputs arrive on this replica's one stream from that worker
                 (WorkerStream: Worker.outputs, one Ray message per engine step for all of this
                 replica's requests there), are routed to the request's queue by rid, and detokenized
                 here, stop strings included (engine/text.py)
              3. Router.finish(worker_id) when the request ends, fails or is cancelled
    GET /router/stats ─▶ Router.stats() (+ this replica's route-RPC latency)
    GET /metrics      ─▶ serving metrics of this replica + per-worker gauges labelled by replica

Aborts: serving closes the backend stream on client disconnect; the request is then aborted on its
worker (Worker.abort), which frees its KV pages. A request whose worker left before anything was
streamed is routed again (MAX_ROUTE_ATTEMPTS). Ingress replicas hold no routing state (it lives in
the router deployment), so they scale freely.
"""

import asyncio
import contextvars
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import FastAPI
from prometheus_client.core import GaugeMetricFamily
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from cluster.latency import IngressLatency, RequestClock
from cluster.router.policies import NoWorkersError
from cluster.worker import WorkerItem, WrongReplicaError
from engine.text import OutputText
from serving.backend import ServingBackend
from serving.errors import APIError

_RPC_TIMEOUT_S = 120.0
MAX_ROUTE_ATTEMPTS = 3
"""Routings per request while its worker is gone before it streamed anything."""

STREAM_OPTIONS = {"stream": True, "_by_reference": False}
"""Handle options of the batched streams from workers: each message goes over Serve's gRPC transport
instead of through the object store (about twice the messages per second)."""


async def _awaited(call: Any) -> Any:
    """The result of a DeploymentResponse, as a coroutine (so that it can run as a task)."""
    return await call


def _detached(fn: Callable[[], Any]) -> Any:
    """fn() run outside the current request's context. Serve cancels the calls an ingress request has in
    flight when that request is cancelled (a client disconnect); a stream that serves many requests, and
    the calls that clean up after one (abort, finish), must not be among them."""
    return contextvars.Context().run(fn)


def _unwrap(exc: BaseException) -> BaseException:
    """The exception raised inside a replica (engine errors keep their type and message)."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def _worker_gone(exc: BaseException) -> bool:
    return isinstance(exc, (ActorDiedError, ActorUnavailableError, WrongReplicaError))


class WorkerStream:
    """This ingress replica's one stream from one worker replica: outputs of all its requests there.

    `open(rid)` gives the queue that the request's WorkerItems go to (registered before the request is
    submitted, so nothing is missed); `close(rid)` forgets it. When the stream fails (the worker died or
    left), every open request gets the error and `on_end` drops this stream (the next request opens a
    new one)."""

    def __init__(self, workers: Any, worker_id: str, ingress_id: str, on_end: Callable[["WorkerStream"], None]):
        self.worker_id = worker_id
        self.queues: Dict[str, asyncio.Queue] = {}
        self.error: Optional[BaseException] = None
        self._on_end = on_end
        self._gen, self._task = _detached(lambda: self._start(workers, ingress_id))

    def _start(self, workers: Any, ingress_id: str) -> tuple:
        gen = workers.options(session_id=self.worker_id, **STREAM_OPTIONS).outputs.remote(ingress_id, self.worker_id)
        return gen, asyncio.ensure_future(self._read(gen))

    def open(self, rid: str) -> "asyncio.Queue[WorkerItem]":
        queue: asyncio.Queue = asyncio.Queue()
        if self.error is not None:
            queue.put_nowait(WorkerItem(rid, error=self.error))
        self.queues[rid] = queue
        return queue

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def _read(self, gen: Any) -> None:
        try:
            async for batch in gen:
                for item in batch:
                    queue = self.queues.get(item.rid)
                    if queue is not None:
                        queue.put_nowait(item)
            error: BaseException = ActorUnavailableError(f"the stream from worker {self.worker_id} ended")
        except asyncio.CancelledError:
            error = ActorUnavailableError(f"the stream from worker {self.worker_id} was cancelled")
        except Exception as exc:  # noqa: BLE001 - handed to every request on this worker
            error = _unwrap(exc)
        self.error = error
        self._on_end(self)
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(WorkerItem(rid, error=error))

    def cancel(self) -> None:
        self._gen.cancel()
        self._task.cancel()


@dataclass
class RequestProgress:
    """What the ingress knows of one request while it streams."""

    running: int
    """Choices still generating on the worker (aborted there if the request ends early)."""
    streamed: bool = False
    """Something reached the client: the request can no longer be retried elsewhere."""
    failed: bool = False
    """An error ended it (from the worker, its submit, or the stream): nothing of it runs there any more."""


class ClusterBackend(ServingBackend):
    """A ServingBackend whose requests run on the worker the router chose."""

    def __init__(self, router, workers, tokenizer: Any, context_len: int, vocab_size: int):
        self.router, self.workers = router, workers
        self.tokenizer, self.context_len, self._vocab_size = tokenizer, context_len, vocab_size
        self.ingress_id = uuid.uuid4().hex
        """Names this backend's streams on the workers."""
        self._streams: Dict[str, WorkerStream] = {}
        self._active: Dict[str, str] = {}
        """rid → worker id of requests streaming now (abort() reaches them there)."""
        self._sent: set = set()
        """Calls in flight that nobody awaits (router.finish, aborts)."""
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

    def stream_from(self, worker_id: str, workers: Any = None) -> WorkerStream:
        """This replica's stream from `worker_id` (opened on first use)."""
        stream = self._streams.get(worker_id)
        if stream is None:
            stream = self._streams[worker_id] = WorkerStream(
                workers or self.workers, worker_id, self.ingress_id, self._stream_ended
            )
        return stream

    def _stream_ended(self, stream: WorkerStream) -> None:
        if self._streams.get(stream.worker_id) is stream:
            del self._streams[stream.worker_id]

    async def generate_stream(self, input_ids: List[int], params: Any, rid: str) -> AsyncIterator[Any]:
        text = OutputText(self.tokenizer, input_ids, params)  # before routing: nothing to finish if it raises
        for attempt in range(1, MAX_ROUTE_ATTEMPTS + 1):
            decision = await self._ask_router(
                self.router.route.remote(input_ids, rid), lambda late: self._finish(late.worker_id)
            )
            worker_id = decision.worker_id
            progress = RequestProgress(params.n)
            clock = RequestClock()  # the worker call → first message (the routing call is timed apart)
            queue = self._open(worker_id, rid)
            self._on_failure(
                self.workers.options(session_id=worker_id).submit.remote(
                    input_ids, params, rid, self.ingress_id, worker_id
                ),
                rid,
                queue,
            )
            try:
                async for out in self._outputs(queue, text, worker_id, rid, params.n, clock, progress):
                    yield out
                return
            except Exception as exc:  # noqa: BLE001 - a worker that left before streaming: route again
                cause = _unwrap(exc)
                if progress.streamed or attempt == MAX_ROUTE_ATTEMPTS or not _worker_gone(cause):
                    raise cause from None
                await self._report_dead(worker_id)
            finally:
                self._close(worker_id, rid, progress)
                self.latency.on_request(clock)
                self._finish(worker_id, timing=clock.timing())

    def _open(self, worker_id: str, rid: str) -> "asyncio.Queue[WorkerItem]":
        """The queue of request `rid`'s items on this replica's stream from `worker_id`."""
        self._active[rid] = worker_id
        return self.stream_from(worker_id).open(rid)

    async def _outputs(
        self,
        queue: "asyncio.Queue[WorkerItem]",
        text: OutputText,
        worker_id: str,
        rid: str,
        n: int,
        clock: RequestClock,
        progress: "RequestProgress",
    ) -> AsyncIterator[Any]:
        """The request's outputs with their text, until its last choice has ended here; raises the error that
        ended it on the worker."""
        while True:
            item = await queue.get()
            if item.error is not None:
                progress.failed = True
                raise item.error
            clock.on_chunk((item.output,))
            progress.running -= item.output.finish_reason is not None
            out = self._with_text(text, item.output, worker_id, rid, n)
            if out is not None:
                progress.streamed = True
                yield out
            if text.finished:
                return

    def _close(self, worker_id: str, rid: str, progress: "RequestProgress") -> None:
        """The request is over here: stop routing its items; abort it on the worker if it still runs there."""
        stream = self._streams.get(worker_id)
        if stream is not None:
            stream.close(rid)
        if self._active.pop(rid, None) is not None and progress.running and not progress.failed:
            self._abort_on(worker_id, rid)

    def _on_failure(self, call: Any, rid: str, queue: "asyncio.Queue[WorkerItem]") -> None:
        """A submit that raises (invalid request, wrong replica) ends the request with its error."""
        task = asyncio.ensure_future(_awaited(call))
        self._sent.add(task)

        def done(t: "asyncio.Task") -> None:
            self._sent.discard(t)
            if not t.cancelled() and t.exception() is not None:
                queue.put_nowait(WorkerItem(rid, error=_unwrap(t.exception())))

        task.add_done_callback(done)

    def _with_text(self, text: OutputText, raw: Any, worker_id: str, rid: str, n: int) -> Optional[Any]:
        """The worker's output with its text (OutputText); a choice of several that a stop string ended
        here is aborted on the worker (a lone choice is aborted when the request ends)."""
        out = text.apply(raw)
        if out is not None and n > 1 and text.stopped_here(out) and not text.finished:
            self._abort_on(worker_id, f"{rid}#{out.index}")
        return out

    async def _report_dead(self, worker_id: str, pool: str = "unified") -> None:
        """Tell the router a worker is gone so that the next routing avoids it."""
        try:
            await asyncio.wait_for(self.router.report_dead.remote(worker_id, pool), 10)
        except Exception:  # noqa: BLE001 - the router's own polling purges it too
            pass

    def _abort_on(self, worker_id: str, engine_rid: str) -> None:
        self._send(lambda: self.workers.options(session_id=worker_id).abort.remote(engine_rid, worker_id))

    def _finish(self, worker_id: str, timing: Any = None) -> None:
        self._send(lambda: self.router.finish.remote(worker_id, timing=timing))

    def _send(self, make_call: Callable[[], Any]) -> None:
        """Make a call and let it run without awaiting its answer (referenced until it completes), outside
        the request's context: it must happen even when the request is being cancelled."""
        task = _detached(lambda: asyncio.ensure_future(_awaited(make_call())))
        self._sent.add(task)
        task.add_done_callback(self._sent.discard)

    def abort(self, rid: str) -> None:
        worker_id = self._active.pop(rid, None)
        if worker_id is not None:
            self._abort_on(worker_id, rid)

    async def cluster_stats(self) -> Any:
        self.last_stats = await asyncio.wait_for(self.router.stats.remote(), 30)
        return self.last_stats

    async def stats(self) -> Dict[str, float]:
        s = await self.cluster_stats()
        engines = [w.engine for w in s.workers.values()]
        kv = [e.get("kv_usage", 0.0) for e in engines]
        return dict(
            running=sum(e.get("running", 0) for e in engines),
            waiting=sum(e.get("waiting", 0) for e in engines),
            kv_usage=sum(kv) / len(kv) if kv else 0.0,
            cache_hit_rate=s.cache_hit_rate,
        )

    async def health(self) -> bool:
        try:
            return bool((await self.cluster_stats()).workers)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False


class WorkerGauges:
    """Prometheus collector: per-worker gauges from the backend's last ClusterStats (refreshed at
    each /metrics scrape before rendering), labelled by pool and replica."""

    _GAUGES = (
        ("running", "radixserve_worker_num_requests_running", "Requests in the worker's running batch."),
        ("waiting", "radixserve_worker_num_requests_waiting", "Requests in the worker's waiting queue."),
        ("kv_usage", "radixserve_worker_kv_cache_usage_ratio", "Worker KV pool share held by requests."),
        ("cache_hit_rate", "radixserve_worker_prefix_cache_hit_rate", "Worker cached / prompt tokens."),
        ("prompt_tokens", "radixserve_worker_prompt_tokens", "Prompt tokens the worker processed."),
        ("cached_tokens", "radixserve_worker_cached_prompt_tokens", "Prompt tokens served from its cache."),
        ("generated_tokens", "radixserve_worker_generation_tokens", "Tokens the worker generated."),
    )
    _ROUTER = (
        ("routed_requests", "radixserve_router_routed_requests", "Requests the router sent to the worker."),
        ("matched_tokens", "radixserve_router_matched_tokens", "Prompt tokens the router's tree held."),
        ("tree_tokens", "radixserve_router_tree_tokens", "Tokens in the router's tree of the worker."),
        ("in_flight", "radixserve_router_in_flight_requests", "Requests routed and not finished."),
    )

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
            for wid, w in s.workers.items() if s is not None else ():
                value = w.engine.get(key, 0.0) if (key, name, doc) in self._GAUGES else getattr(w, key)
                g.add_metric([self.model_name, w.pool, wid], float(value))
            families.append(g)
        lat = GaugeMetricFamily(
            "radixserve_router_decision_latency_ms", "Routing decision time in the router.", labels=["quantile"]
        )
        for q in ("p50", "p99"):
            lat.add_metric([q], float(s.route_latency_ms.get(q, 0.0)) if s is not None else 0.0)
        families.append(lat)
        return families


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
        self.admin_api_key = admin_api_key
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(tokenizer_source or model))
        info = await asyncio.wait_for(workers.info.remote(), 600)  # waits for a first worker to be up
        if mode == "disaggregated":
            from cluster.disaggregated import DisaggregatedBackend

            self.backend = DisaggregatedBackend(
                router, workers, tokenizer, info.context_len, info.vocab_size, prefill=prefill
            )
        else:
            self.backend = ClusterBackend(router, workers, tokenizer, info.context_len, info.vocab_size)

    def __serve_build_asgi_app__(self) -> FastAPI:
        from cluster.admin import install_admin
        from serving.app import build_app

        app = build_app(
            self.backend,
            api_key=self.api_key,
            model_name=self.model_name,
            max_body_bytes=self.max_body_bytes,
            title="radixserve cluster",
        )
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
