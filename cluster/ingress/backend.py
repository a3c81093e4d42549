"""ClusterBackend: the ingress's ServingBackend, whose requests run on the worker the router chose.

    HTTP ─▶ serving.build_app routes (validate, chat template, tokenize ONCE)
         ─▶ ClusterBackend.generate_stream(input_ids, params, rid)
              1. Router.route_many([(input_ids, rid), ...]) ─▶ RoutingDecision: one small RPC for the
                 prompts this replica has waiting (CallBatcher: at most one routing call in flight)
              2. Worker.submit(input_ids, params, rid, ...), pinned to decision.worker_id (session_id +
                 PinnedRequestRouter); the outputs arrive on this replica's one stream from that worker
                 (WorkerStream: Worker.outputs, one Ray message per engine step for all of this
                 replica's requests there), are routed to the request's queue by rid, and detokenized
                 here, stop strings included (engine/text.py)
              3. Router.finish_many([(worker_id, ...), ...]) when the request ends, fails or is cancelled
                 (batched like the routing calls)
    GET /router/stats ─▶ Router.stats() (+ this replica's route-RPC latency)
    GET /metrics      ─▶ serving metrics of this replica + per-worker gauges labelled by replica

Aborts: serving closes the backend stream on client disconnect; the request is then aborted on its
worker (Worker.abort, under its attempt's id there: _attempt_rid), which frees its KV pages. A request
whose worker left before anything was streamed is routed again; one that left mid-stream is continued on
another worker from the tokens generated so far (Continuation: the client sees one uninterrupted stream),
MAX_ROUTE_ATTEMPTS in all.
Ingress replicas hold no routing state (it lives in the router deployment), so they scale freely.

Load (503 queue_full + Retry-After, fastest first):
    - this replica's app already holds as many HTTP requests as the pool admits: refused before the body
      is read (serving.admission.AdmissionGate over `admission_limit()`);
    - this replica alone holds as many requests as the pool admits (the capacity the router's last
      decision reported): refused at once, no call at all (the router's count covers every ingress
      replica, so this is only a lower bound of the pool's load: it never refuses what the pool admits);
    - the router finds every worker full (its in_flight vs each worker's reported capacity):
      PoolFullError, no worker called;
    - a worker refuses (QueueFullError from its engine): the request is routed again, to a worker that
      has not refused it, within MAX_ROUTE_ATTEMPTS.
"""

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Deque, Dict, List, Optional, Tuple

from ray.exceptions import ActorUnavailableError

from cluster.ingress.latency import IngressLatency, RequestClock
from serving.call_batcher import CallBatcher
from cluster.router.policies import Finished, NoWorkersError, RouteRequest
from cluster.rpc import STREAM_OPTIONS, awaited, detached, is_dead, unwrap
from cluster.workers.base import WorkerItem, WrongReplicaError
from cluster.router.policies import PoolFullError
from engine.errors import InvalidRequestError, QueueFullError
from engine.sampling_params import SamplingParams
from engine.text import OutputText
from serving.backend import ServingBackend, ServingLoad
from serving.errors import RETRY_AFTER_S, APIError, queue_full

if TYPE_CHECKING:  # pragma: no cover
    from cluster.router.router import ClusterStats


logger = logging.getLogger("ray.serve")

_RPC_TIMEOUT_S = 120.0


MAX_ROUTE_ATTEMPTS = 3
"""Routings per request, in unified and disaggregated mode: the first, and one more for each worker (or
pair) that left under it, failed or refused it, before or while it streamed."""


ATTEMPT_SEP = "@"
"""Separates a request's id from its attempt number in the ids of its later attempts (refused in a client's)."""


def attempt_rid(rid: str, attempt: int) -> str:
    """The id under which attempt number `attempt` (from 1) of request `rid` runs on its replicas: `rid` itself
    for the first, `<rid>@<attempt>` for the next ones ("#" is taken: an engine runs choice i of a request of
    several as "<rid>#<i>")."""
    return rid if attempt == 1 else f"{rid}{ATTEMPT_SEP}{attempt}"


def no_workers(message: str) -> APIError:
    """The 503 of a cluster that has no replica able to take a request now: code no_workers, with Retry-After."""
    return APIError(503, message, None, "no_workers", retry_after=RETRY_AFTER_S)


def _worker_gone(exc: BaseException) -> bool:
    return is_dead(exc) or isinstance(exc, WrongReplicaError)


def may_continue(
    cause: BaseException,
    progress: "RequestProgress",
    continuation: "Continuation",
    attempt: int,
    retryable: Callable[[BaseException], bool],
) -> bool:
    """Whether failed attempt number `attempt` is tried again on another worker: the failure is `retryable`,
    attempts are left (MAX_ROUTE_ATTEMPTS), and nothing was streamed yet or the request can be continued from
    its tokens so far."""
    if attempt >= MAX_ROUTE_ATTEMPTS or not retryable(cause):
        return False
    return not progress.streamed or continuation.resumable


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
        self._gen, self._task = detached(lambda: self._start(workers, ingress_id))

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
            error: BaseException = ActorUnavailableError(f"the stream from worker {self.worker_id} ended", None)
        except asyncio.CancelledError:
            error = ActorUnavailableError(f"the stream from worker {self.worker_id} was cancelled", None)
        except Exception as exc:  # noqa: BLE001 - handed to every request on this worker
            error = unwrap(exc)
        self.error = error
        self._on_end(self)
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(WorkerItem(rid, error=error))

    def cancel(self) -> None:
        self._gen.cancel()
        self._task.cancel()


class Continuation:
    """What a request (n == 1) has generated so far, so that it can go on elsewhere when its worker dies
    mid-stream: the next attempt's prompt is the original prompt followed by every token generated, its
    budget what is left of max_new_tokens; the radix cache of the new worker makes the common prefix
    cheap. Outputs of a continued attempt are renumbered as the client's one request (prompt_tokens,
    completion_tokens, cached_tokens of the first attempt). Greedy continuations are token-identical;
    seeded sampling continues with a fresh generator (its draws differ after the cut), and a grammar
    constraint or prompt logprobs cannot be resumed, so those requests fail as before."""

    def __init__(self, input_ids: List[int], params: SamplingParams):
        self.input_ids, self.params = input_ids, params
        constrained = params.constrained
        self.resumable = params.n == 1 and not constrained and params.prompt_logprobs is None
        """Whether the request can go on elsewhere after a cut (decided once)."""
        self.generated: List[int] = []
        """Tokens generated so far (recorded only when resumable: nothing else reads them)."""
        self._base = 0
        """Tokens generated before the current attempt."""
        self._cached: Optional[int] = None

    def attempt(self) -> Tuple[List[int], SamplingParams]:
        """The prompt and params of the next attempt."""
        self._base = done = len(self.generated)
        if not done:
            return self.input_ids, self.params
        return self.input_ids + self.generated, dataclasses.replace(
            self.params, max_new_tokens=self.params.max_new_tokens - done
        )

    def seen(self, out: Any) -> Any:
        """`out` (a worker's StreamOutput) as an output of the client's request; records its tokens when the
        request is resumable."""
        if self.resumable:
            self.generated.extend(out.new_token_ids)
        if not self._base:
            self._cached = out.cached_tokens
            return out
        return dataclasses.replace(
            out,
            prompt_tokens=len(self.input_ids),
            cached_tokens=self._cached if self._cached is not None else 0,
            completion_tokens=out.completion_tokens + self._base,
        )


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
        self._active: Dict[str, Tuple[str, str]] = {}
        """rid → (worker id, the attempt's id there: attempt_rid) of requests streaming now (abort() reaches
        them there)."""
        self._sent: set = set()
        """Calls in flight that nobody awaits (router.finish, aborts)."""
        self.latency = IngressLatency()
        """This replica's routing-call and call → first message times (GET /router/stats, "ingress")."""
        self.last_stats: Optional["ClusterStats"] = None
        """The last ClusterStats fetched (for the per-worker metrics collector)."""
        self._rids: set = set()
        """Ids of this replica's requests between their arrival here and their end."""
        self.route_calls = CallBatcher("routing", lambda requests: self.router.route_many.remote(requests))
        """This replica's routing calls, batched (unified mode; disaggregated mode routes pairs one by one)."""
        self.finish_calls = CallBatcher("finish", lambda finished: self.router.finish_many.remote(finished))
        """This replica's Router.finish calls, batched."""
        self.pool_capacity: Optional[int] = None
        """Requests the (decode or unified) pool admits, from the router's last decision; None: unknown."""

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def held(self) -> int:
        """Requests of this replica between their arrival here and their end."""
        return len(self._rids)

    def close(self) -> None:
        """This replica is stopping: end its stream from every worker (a worker counts an open stream as a
        request in progress, so it would otherwise wait out its whole graceful shutdown for it)."""
        for stream in list(self._streams.values()):
            stream.cancel()
        self._streams.clear()

    def admission_limit(self) -> Optional[int]:
        """The pool's capacity as the router last reported it (see ServingBackend.admission_limit): the HTTP
        requests this replica holds are at most the pool's load, so no request the pool admits is refused."""
        return self.pool_capacity

    async def _ask_router(self, make_call: Callable[[], Any], finish: Callable[[Any], None]) -> Tuple[Any, float]:
        """Await the routing call `make_call()` (bounded): (decision, the call's milliseconds, also recorded in
        self.latency); no worker → HTTP 503.

        The router counts the request in flight as soon as it decides. If this caller gives up first
        (client disconnect: cancelled; or the bound ran out), the decision may still come: `finish(decision)`
        then runs when it does, so the router does not count a request that never ran. The call is made
        detached: Serve would otherwise cancel it with the request, after the router counted it."""
        start = time.perf_counter()
        task = asyncio.ensure_future(awaited(detached(make_call)))
        try:
            decision = await asyncio.wait_for(asyncio.shield(task), _RPC_TIMEOUT_S)
        except BaseException as exc:
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or finish(t.result()))
            if not isinstance(exc, Exception):
                raise
            exc = unwrap(exc)
            if isinstance(exc, NoWorkersError):
                raise no_workers(f"no worker replica is available: {exc}") from None
            if isinstance(exc, PoolFullError):
                raise queue_full(f"the cluster is full: {exc}; retry later") from None
            raise exc
        route_ms = (time.perf_counter() - start) * 1e3
        self.latency.on_route(route_ms)
        return decision, route_ms

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
        """The request's outputs (see `_attempts`); refused at once when this replica alone holds as many
        requests as the pool admits. `rid` is the client's (SGLang's /generate takes one) or the routes' own:
        it must not be in flight on this replica (its worker stream routes outputs by id) nor contain
        ATTEMPT_SEP (reserved for the ids of later attempts): InvalidRequestError otherwise."""
        if ATTEMPT_SEP in rid:
            raise InvalidRequestError(f"request id {rid!r}: {ATTEMPT_SEP!r} is reserved for retries", param="rid")
        if rid in self._rids:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        capacity = self.pool_capacity
        if capacity is not None and self.held >= capacity:
            raise queue_full(f"the cluster is full ({capacity} requests admitted by its workers); retry later")
        self._rids.add(rid)
        try:
            async for out in self._attempts(input_ids, params, rid):
                yield out
        finally:
            self._rids.discard(rid)

    async def _attempts(self, input_ids: List[int], params: Any, rid: str) -> AsyncIterator[Any]:
        """Route, submit, stream; again elsewhere when a worker refuses (full), fails or leaves: one skeleton
        for both modes, whose steps (`_route`, `_submit`, `_end_attempt`, ...) each mode defines.

        The router and the client see the request as `rid` (its in_flight count, stats, abort(rid)); each
        attempt runs on its replicas under the id `_attempt_rid` gives it, which its submit, its stream's
        items and its aborts carry."""
        params = self._prepare(params)
        text = OutputText(self.tokenizer, input_ids, params)  # before routing: nothing to finish if it raises
        continuation = Continuation(input_ids, params)
        refused: List[str] = []
        """Workers (decode replicas) that answered queue_full: not asked again for this request."""
        for attempt in range(1, MAX_ROUTE_ATTEMPTS + 1):
            ids, attempt_params = continuation.attempt()
            placement, route_ms = await self._ask_router(
                lambda: self._route(ids, rid, tuple(refused)), lambda late: self._release(late, RequestClock())
            )
            worker_id = self._streaming_worker(placement)
            engine_rid = self._attempt_rid(rid, attempt)
            progress = RequestProgress(params.n)
            clock = RequestClock(route_ms)  # the worker call → first message
            queue = self._open(worker_id, rid, engine_rid)
            started = self._submit(placement, ids, attempt_params, engine_rid, attempt, queue)
            try:
                async for out in self._outputs(
                    queue, text, worker_id, engine_rid, params.n, clock, progress, continuation
                ):
                    yield out
                return
            except Exception as exc:  # noqa: BLE001 - a worker that left, failed or is full: route again
                cause = unwrap(exc)
                retry = may_continue(cause, progress, continuation, attempt, self._retryable)
                await self._report_failure(placement, cause)
                if not retry:
                    raise self._final_error(cause) from None
                if isinstance(cause, QueueFullError):
                    refused.append(worker_id)
                    logger.debug("request %s: worker %s is full; routing it again", rid, worker_id)
                    continue
                logger.warning(
                    "request %s: attempt %d on %s failed after %d tokens (%r); going on elsewhere",
                    rid,
                    attempt,
                    worker_id,
                    len(continuation.generated),
                    cause,
                )
            finally:
                self._close(worker_id, rid, engine_rid, progress)
                self.latency.on_request(clock)
                self._end_attempt(placement, clock, progress, started)

    # --- the steps of one attempt in unified mode (DisaggregatedBackend defines its own) -----------------

    def _retryable(self, cause: BaseException) -> bool:
        """Whether another worker may take a failed attempt (may_continue decides with the progress): this
        one is gone, or full (QueueFullError)."""
        return _worker_gone(cause) or isinstance(cause, QueueFullError)

    def _prepare(self, params: SamplingParams) -> SamplingParams:
        """The request's params for every attempt."""
        return params

    def _attempt_rid(self, rid: str, attempt: int) -> str:
        """The id attempt number `attempt` of request `rid` runs under on its worker. Unified: `rid` for every
        attempt, since a retry never goes back to a worker that held the request (that worker refused it, or
        is reported gone and left out), so no engine sees the id twice."""
        return rid

    def _final_error(self, cause: BaseException) -> BaseException:
        """What the client gets for `cause`, the failure that ended the request (not retryable, or no attempt
        left): for a worker that died or left, the 503 of a cluster that cannot take the request now
        (no_workers, with Retry-After: the client may send it again); else the failure itself
        (serving.errors.to_api_error makes its status)."""
        if _worker_gone(cause):
            return no_workers(
                f"the worker replica serving this request left, and it could not be completed on another "
                f"({MAX_ROUTE_ATTEMPTS} attempts at most): {cause}"
            )
        return cause

    def _route(self, ids: List[int], rid: str, refused: Tuple[str, ...]) -> Any:
        """The routing call: a RoutingDecision, not one of `refused` (they answered queue_full); batched with
        this replica's other prompts waiting for one (serving/call_batcher.py)."""
        return self.route_calls.submit(RouteRequest(ids, rid, refused))

    def _streaming_worker(self, placement: Any) -> str:
        """The worker whose stream carries the attempt's outputs; records the pool's capacity."""
        self.pool_capacity = placement.pool_capacity
        return placement.worker_id

    def _submit(self, placement: Any, ids: List[int], params: Any, rid: str, attempt: int, queue: Any) -> Any:
        """Start the attempt on its worker under `rid` (the attempt's id: _attempt_rid) (not awaited; a submit
        that raises fails `queue`); returns what `_end_attempt` needs."""
        worker_id = placement.worker_id
        call = self.workers.options(session_id=worker_id).submit.remote(ids, params, rid, self.ingress_id, worker_id)
        self._on_failure(call, rid, queue)
        return None

    async def _report_failure(self, placement: Any, cause: BaseException) -> None:
        """Tell the router of a worker that is gone, so that the next routing avoids it."""
        if _worker_gone(cause):
            await self._report_dead(placement.worker_id)

    def _release(self, placement: Any, clock: RequestClock) -> None:
        """The attempt's worker no longer holds it (Router.finish, with the ingress's timing)."""
        self._finish(placement.worker_id, timing=clock.timing())

    def _end_attempt(self, placement: Any, clock: RequestClock, progress: "RequestProgress", started: Any) -> None:
        self._release(placement, clock)

    def _open(self, worker_id: str, rid: str, engine_rid: str) -> "asyncio.Queue[WorkerItem]":
        """The queue of the items of request `rid`'s attempt `engine_rid` (its id there) on this replica's
        stream from `worker_id`."""
        self._active[rid] = (worker_id, engine_rid)
        return self.stream_from(worker_id).open(engine_rid)

    async def _outputs(
        self,
        queue: "asyncio.Queue[WorkerItem]",
        text: OutputText,
        worker_id: str,
        engine_rid: str,
        n: int,
        clock: RequestClock,
        progress: "RequestProgress",
        continuation: Continuation,
    ) -> AsyncIterator[Any]:
        """The request's outputs with their text, until its last choice has ended here (attempt `engine_rid`
        on `worker_id`); raises the error that ended it on the worker.

        When this replica falls behind (its event loop busy with other streams), the outputs of one choice
        already waiting in `queue`, one after the other, are handed on as one (StreamOutput.then), as
        `Engine.generate_stream(coalesce=True)` does for the single-node server: a loaded ingress then
        detokenizes, encodes and writes fewer, larger deltas instead of falling further behind. Tokens,
        text, logprobs and finish are the same; an error waiting behind outputs is raised after them."""
        ready: Deque[WorkerItem] = collections.deque()
        while True:
            if not ready:
                ready.append(await queue.get())
            while not queue.empty():
                ready.append(queue.get_nowait())
            item = ready.popleft()
            if item.error is not None:
                progress.failed = True
                raise item.error
            raw = item.output
            clock.on_chunk((raw,))
            while ready and ready[0].error is None and raw.continues_with(ready[0].output):
                later = ready.popleft().output
                clock.on_chunk((later,))
                raw = raw.then(later)
            progress.running -= raw.finish_reason is not None
            out = self._with_text(text, continuation.seen(raw), worker_id, engine_rid, n)
            if out is not None:
                progress.streamed = True
                yield out
            if text.finished:
                return

    def _close(self, worker_id: str, rid: str, engine_rid: str, progress: "RequestProgress") -> None:
        """Request `rid`'s attempt `engine_rid` is over here: stop routing its items; abort it on the worker if
        it still runs there (and abort(rid) did not)."""
        stream = self._streams.get(worker_id)
        if stream is not None:
            stream.close(engine_rid)
        if self._active.pop(rid, None) is not None and progress.running and not progress.failed:
            self._abort_on(worker_id, engine_rid)

    def _on_failure(self, call: Any, rid: str, queue: "asyncio.Queue[WorkerItem]") -> None:
        """A submit that raises (invalid request, wrong replica) ends the request with its error."""
        task = asyncio.ensure_future(awaited(call))
        self._sent.add(task)

        def done(t: "asyncio.Task") -> None:
            self._sent.discard(t)
            if not t.cancelled() and t.exception() is not None:
                queue.put_nowait(WorkerItem(rid, error=unwrap(t.exception())))

        task.add_done_callback(done)

    def _with_text(self, text: OutputText, raw: Any, worker_id: str, engine_rid: str, n: int) -> Optional[Any]:
        """The worker's output with its text (OutputText); a choice of several that a stop string ended
        here is aborted on the worker (a lone choice is aborted when the request ends)."""
        out = text.apply(raw)
        if out is not None and n > 1 and text.stopped_here(out) and not text.finished:
            self._abort_on(worker_id, f"{engine_rid}#{out.index}")
        return out

    async def _report_dead(self, worker_id: str, pool: str = "unified") -> None:
        """Tell the router a worker is gone so that the next routing avoids it."""
        try:
            await asyncio.wait_for(self.router.report_dead.remote(worker_id, pool), 10)
        except Exception:  # noqa: BLE001 - the router's own polling purges it too
            pass

    def _abort_on(self, worker_id: str, engine_rid: str) -> None:
        self._send(lambda: self.workers.options(session_id=worker_id).abort.remote(engine_rid, worker_id))

    def _finish(self, worker_id: str, timing: Any = None, pool: str = "unified") -> None:
        """Router.finish, batched with this replica's other finishes (nobody waits for it)."""
        self.finish_calls.submit_nowait(Finished(worker_id, pool, timing))

    def _send(self, make_call: Callable[[], Any]) -> None:
        """Make a call and let it run without awaiting its answer (referenced until it completes), outside
        the request's context: it must happen even when the request is being cancelled."""
        task = detached(lambda: asyncio.ensure_future(awaited(make_call())))
        self._sent.add(task)
        task.add_done_callback(self._sent.discard)

    def abort(self, rid: str) -> None:
        """Abort request `rid`: its live attempt, on its worker, under the attempt's id."""
        active = self._active.pop(rid, None)
        if active is not None:
            self._abort_on(*active)

    async def cluster_stats(self) -> "ClusterStats":
        self.last_stats = await asyncio.wait_for(self.router.stats.remote(), 30)
        return self.last_stats

    async def stats(self) -> ServingLoad:
        s = await self.cluster_stats()
        engines = [w.reported.engine if w.reported is not None else None for w in s.workers.values()]
        kv = [e.kv_usage if e is not None else 0.0 for e in engines]  # a worker not reported yet: 0
        reported = [e for e in engines if e is not None]
        return ServingLoad(
            running=sum(e.running for e in reported),
            waiting=sum(e.waiting for e in reported),
            kv_usage=sum(kv) / len(kv) if kv else 0.0,
            cache_hit_rate=s.cache_hit_rate,
            kv_total_tokens=sum(e.kv_total_tokens for e in reported),
            kv_free_tokens=sum(e.kv_free_tokens for e in reported),
            kv_evictable_tokens=sum(e.kv_evictable_tokens for e in reported),
        )

    async def health(self) -> bool:
        try:
            return bool((await self.cluster_stats()).workers)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False
