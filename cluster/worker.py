"""Worker: one engine.Engine per Serve replica (the unified pool).

    ingress ──generate(input_ids, params, rid), pinned by session_id──▶ Worker.generate
        ◀── List[StreamOutput] per message: everything the engine produced since the last one
            (token ids, logprobs, finish; no text: the ingress detokenizes and checks stop strings,
            and aborts a choice it stopped with abort(rid))
    router  ──report() every report_interval_s, pinned──▶ WorkerReport (load + drained cache events)

Coalescing: a pump task moves the engine's StreamOutputs into a queue; each yielded message
takes all that is queued (at least one engine step's outputs, more when the caller lags), so Ray
pays its per-message cost once per step, not per token (RAY_SERVE_NOTES §3).

Aborts: when the caller cancels the stream (client disconnect), Serve cancels this generator;
its `finally` cancels the pump, whose engine stream aborts the request and frees its KV pages.
"""
import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional

from ray import serve


@dataclass(frozen=True)
class WorkerInfo:
    replica_id: str
    context_len: int
    vocab_size: int


@dataclass(frozen=True)
class WorkerReport:
    """What the router learns from one poll of one worker."""
    replica_id: str
    queue_len: int
    """Waiting requests in the engine."""
    running: int
    kv_usage: float
    """Share of the KV pool held by requests, in [0, 1]."""
    events: List[Any]
    """engine CacheEvents drained since the previous report, in order."""
    stats: Dict[str, float] = field(default_factory=dict)
    """engine.stats() at report time (counters for /metrics)."""
    time: float = 0.0


class Worker:
    def __init__(self, model: Optional[str], engine_options: Dict[str, Any]):
        from engine import Engine  # heavy: torch, transformers

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Token ids only: the ingress makes the text and checks stop strings (DESIGN §1).
        self.engine = Engine(model, enable_cache_events=True, detokenize=False, **engine_options)
        self._served: collections.deque = collections.deque(maxlen=4096)
        """rids of recent generate calls (the pinning proof reads them)."""
        self._first_output = {"first_output_s": 0.0, "first_output_requests": 0}
        """Sum over streamed requests of call start → first message yielded (this replica's share of the
        TTFT: with the client's TTFT it splits time inside the worker from ingress, router and transport)."""

    async def generate(self, input_ids: List[int], params: Any, rid: str) -> AsyncIterator[List[Any]]:
        """Stream the request's outputs: lists of engine.StreamOutput (see the module docstring)."""
        async for batch in self._stream(input_ids, params, rid):
            yield batch

    async def _stream(self, input_ids: List[int], params: Any, rid: str,
                      remote_prefill: Any = None) -> AsyncIterator[List[Any]]:
        """engine.generate_stream, coalesced into one list per message (remote_prefill: see Engine)."""
        self._served.append(rid)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for out in self.engine.generate_stream(input_ids, params, rid=rid,
                                                             remote_prefill=remote_prefill):
                    queue.put_nowait(out)
                queue.put_nowait(done)
            except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
                queue.put_nowait(exc)

        task = asyncio.ensure_future(pump())
        start, first = time.perf_counter(), True
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = batch[-1] is done
                if finished:
                    batch.pop()
                if batch and isinstance(batch[-1], Exception):
                    if len(batch) > 1:
                        yield batch[:-1]
                    raise batch[-1]
                if batch:
                    if first:
                        first = False
                        self._first_output["first_output_s"] += time.perf_counter() - start
                        self._first_output["first_output_requests"] += 1
                    yield batch
                if finished:
                    return
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def report(self) -> WorkerReport:
        stats = await self.stats()
        events = await asyncio.to_thread(self.engine.drain_cache_events)
        return WorkerReport(self.replica_id, int(stats.get("waiting", 0)), int(stats.get("running", 0)),
                            float(stats.get("kv_usage", 0.0)), events, stats, time.time())

    async def stats(self) -> Dict[str, float]:
        return {**await asyncio.to_thread(self.engine.stats), **self._extra_stats()}

    def _extra_stats(self) -> Dict[str, float]:
        """Counters of this replica beside the engine's (reported with them)."""
        return dict(self._first_output)

    def abort(self, rid: str) -> None:
        """Abort request (or choice: "<rid>#<i>") `rid` here; a no-op when it is gone."""
        self.engine.abort(rid)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.replica_id, self.engine.context_len, self.engine.runner.vocab_size)

    def whoami(self) -> str:
        return self.replica_id

    def served(self) -> Dict[str, List[str]]:
        """{this replica's id: rids of its last 4096 generate calls} (tests prove pinning with it)."""
        return {self.replica_id: list(self._served)}

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        await asyncio.wait_for(asyncio.to_thread(self.engine.stats), timeout=30)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
