"""DisaggregatedBackend: the ingress's backend in mode=disaggregated, which pairs a prefill and a decode replica.

One request (docs/disaggregation.md):

    1. Router.route_pair(input_ids) ─▶ PairDecision(prefill replica, decode replica)
    2. PrefillWorker.start_prefill(input_ids, params, rid, key), pinned, not awaited (early_prefill): the
       prompt starts computing now and waits on the prefill replica under `key`
    3. DecodeWorker.submit_disaggregated(input_ids, params, rid, prefill_id, key, ...), pinned: the decode
       replica reserves pages, calls the prefill replica (which claims the started prompt and writes its KV)
       and decodes; its outputs come on this replica's batched stream from it, and the text is made here
    4. Router.finish for both replicas

Both calls carry the same seed (drawn here when the request has none), so the first token is sampled as in
unified mode. A started prompt nobody claims (the request ended first, or a retry moved it) is dropped: by
forget_prefill, else after kv_transfer_timeout_s. A failure before any token reached the client (either
replica's death, a transfer failure or timeout, a full replica) is retried on a new pair, up to
backend.MAX_ROUTE_ATTEMPTS in all (a decode replica that answered queue_full is not asked again; the router
refuses at once when the decode pool is full, as in unified mode: backend.py, "Load"); dead replicas are
reported to the router first so that the new pair avoids them. A decode replica that dies
mid-stream is replaced the same way: the new pair continues the request from the tokens generated so far
(backend.Continuation), so the client sees one stream. Other failures after the first token reach the client.
"""

import asyncio
import dataclasses
import logging
import random
import uuid
from typing import Any, AsyncIterator, List

from cluster.ingress.backend import MAX_ROUTE_ATTEMPTS, ClusterBackend, Continuation, RequestProgress, may_continue
from cluster.latency import RequestClock
from cluster.rpc import is_dead, unwrap
from cluster.workers.base import WrongReplicaError
from cluster.workers.handoff import PrefillFailedError
from engine.errors import QueueFullError
from engine.text import OutputText

logger = logging.getLogger("ray.serve")


def _retryable(cause: BaseException) -> bool:
    """A failure that another pair may not meet: a replica died, left or is full, or the prefill failed."""
    return isinstance(cause, (PrefillFailedError, WrongReplicaError, QueueFullError)) or is_dead(cause)


class DisaggregatedBackend(ClusterBackend):
    """The ingress backend of mode=disaggregated: `workers` is the decode pool's handle; with `prefill`
    (the prefill pool's handle) each prompt starts on its prefill replica when the request arrives."""

    def __init__(self, *args: Any, prefill: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prefill_pool = prefill

    async def _attempts(self, input_ids: List[int], params: Any, rid: str) -> AsyncIterator[Any]:
        if self.prefill_pool is not None and params.seed is None:  # both replicas must sample alike
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        text = OutputText(self.tokenizer, input_ids, params)
        continuation = Continuation(input_ids, params)
        refused: List[str] = []
        """Decode replicas that answered queue_full: not asked again for this request."""
        for attempt in range(1, MAX_ROUTE_ATTEMPTS + 1):
            ids, attempt_params = continuation.attempt()
            pair, route_ms = await self._ask_router(
                lambda: self.router.route_pair.remote(ids, rid, exclude_decode=tuple(refused)),
                lambda late: self._finish_pair(late, RequestClock()),
            )
            self.pool_capacity = pair.decode.pool_capacity
            progress, clock = RequestProgress(params.n), RequestClock(route_ms)
            decode_id = pair.decode.worker_id
            early_key = self._start_prefill(ids, attempt_params, rid, pair.prefill.worker_id, attempt)
            queue = self._open(decode_id, rid)
            self._on_failure(
                self.workers.options(session_id=decode_id).submit_disaggregated.remote(
                    ids, attempt_params, rid, pair.prefill.worker_id, early_key, self.ingress_id, decode_id
                ),
                rid,
                queue,
            )
            try:
                async for out in self._outputs(queue, text, decode_id, rid, params.n, clock, progress, continuation):
                    yield out
                return
            except Exception as exc:  # noqa: BLE001 - a pair that failed: a new pair, continuing the stream
                cause = unwrap(exc)
                retry = may_continue(cause, progress, continuation, attempt, _retryable)
                await self._report_failure(pair, cause)
                if not retry:
                    raise cause from None
                if isinstance(cause, QueueFullError):
                    refused.append(decode_id)
                    continue
                logger.warning(
                    "request %s: attempt %d failed after %d tokens (%r); going on with a new pair",
                    rid,
                    attempt,
                    len(continuation.generated),
                    cause,
                )
            finally:
                self._close(decode_id, rid, progress)
                self.latency.on_request(clock)
                self._finish_pair(pair, clock)
                if early_key and not progress.streamed:  # claimed already if a token came; else drop it now
                    self._send(
                        lambda: self.prefill_pool.options(session_id=pair.prefill.worker_id).forget_prefill.remote(
                            early_key
                        )
                    )

    def _start_prefill(self, input_ids: List[int], params: Any, rid: str, prefill_id: str, attempt: int) -> str:
        """Start the prompt on its prefill replica (not awaited); returns the key its decode replica's
        prefill call claims it by, or "" when early_prefill is off."""
        if self.prefill_pool is None or params.n != 1:  # n > 1 is refused by the decode replica
            return ""
        key = f"{rid}@{attempt}.{uuid.uuid4().hex[:6]}"
        self._send(
            lambda: self.prefill_pool.options(session_id=prefill_id).start_prefill.remote(
                input_ids, params, rid, key, prefill_id
            )
        )
        return key

    async def _report_failure(self, pair: Any, cause: BaseException) -> None:
        """Tell the router which replica is gone so that the next pair avoids it."""
        dead = []
        if isinstance(cause, PrefillFailedError) and cause.prefill_dead:
            dead.append((cause.prefill_id, "prefill"))
        elif is_dead(cause):
            dead.append((pair.decode.worker_id, "decode"))
        for worker_id, pool in dead:
            try:
                await asyncio.wait_for(self.router.report_dead.remote(worker_id, pool), 10)
            except Exception:  # noqa: BLE001 - the router's own polling purges it too
                logger.debug("report_dead(%s) failed", worker_id, exc_info=True)

    def _finish_pair(self, pair: Any, clock: RequestClock) -> None:
        timing = clock.timing()  # TTFT concerns the prefill pool, ITL the decode pool: both get both
        for worker_id, pool in ((pair.prefill.worker_id, "prefill"), (pair.decode.worker_id, "decode")):
            self._send(lambda: self.router.finish.remote(worker_id, pool=pool, timing=timing))
