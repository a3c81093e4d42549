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
(backend.Continuation), so the client sees one stream. Other failures after the first token reach the client;
a prefill that failed on every attempt is a 503 no_workers with Retry-After (backend.no_workers).

Each attempt runs on both replicas under an id of its own (backend.attempt_rid: `rid`, then `<rid>@2`, ...):
a retry may reach a replica where the previous attempt still holds its id — the prefill replica, whose call
from a decode replica that died runs on until its transfer fails, or the same decode replica after a failed
prefill, whose engine frees the id once its core has confirmed the abort. The router, the client and
abort(rid) see the request as `rid`.
"""

import asyncio
import dataclasses
import logging
import random
import uuid
from typing import Any, List, Tuple

from cluster.ingress.backend import MAX_ROUTE_ATTEMPTS, ClusterBackend, RequestProgress, attempt_rid, no_workers
from cluster.ingress.latency import RequestClock
from cluster.rpc import is_dead
from cluster.workers.base import WrongReplicaError
from cluster.workers.handoff import PrefillFailedError
from engine.errors import QueueFullError
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")


class DisaggregatedBackend(ClusterBackend):
    """The ingress backend of mode=disaggregated: `workers` is the decode pool's handle; with `prefill`
    (the prefill pool's handle) each prompt starts on its prefill replica when the request arrives."""

    def __init__(self, *args: Any, prefill: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prefill_pool = prefill

    # --- the steps of one attempt (ClusterBackend._attempts) ---------------------------------------------

    def _retryable(self, cause: BaseException) -> bool:
        """A failure that another pair may not meet: a replica died, left or is full, or the prefill failed."""
        return isinstance(cause, (PrefillFailedError, WrongReplicaError, QueueFullError)) or is_dead(cause)

    def _prepare(self, params: SamplingParams) -> SamplingParams:
        if self.prefill_pool is not None and params.seed is None:  # both replicas must sample alike
            return dataclasses.replace(params, seed=random.getrandbits(62))
        return params

    def _attempt_rid(self, rid: str, attempt: int) -> str:
        """An id of its own for each attempt (see the module docstring)."""
        return attempt_rid(rid, attempt)

    def _final_error(self, cause: BaseException) -> BaseException:
        """A prefill that failed on every attempt: the 503 of a cluster that cannot take the request now
        (no_workers, as when the router has no replica), not a server error."""
        if isinstance(cause, PrefillFailedError):
            return no_workers(f"the prompt's prefill failed on all {MAX_ROUTE_ATTEMPTS} attempts; the last: {cause}")
        return super()._final_error(cause)

    def _route(self, ids: List[int], rid: str, refused: Tuple[str, ...]) -> Any:
        return self.router.route_pair.remote(ids, rid, exclude_decode=refused)

    def _streaming_worker(self, placement: Any) -> str:
        self.pool_capacity = placement.decode.pool_capacity
        return placement.decode.worker_id

    def _submit(self, placement: Any, ids: List[int], params: Any, rid: str, attempt: int, queue: Any) -> str:
        """Start the prompt on the prefill replica (early_prefill) and the request on the decode replica, under
        `rid`, the attempt's id (which the decode replica's prefill call carries too); returns the early-prefill
        key ("" without)."""
        prefill_id, decode_id = placement.prefill.worker_id, placement.decode.worker_id
        early_key = self._start_prefill(ids, params, rid, prefill_id)
        call = self.workers.options(session_id=decode_id).submit_disaggregated.remote(
            ids, params, rid, prefill_id, early_key, self.ingress_id, decode_id
        )
        self._on_failure(call, rid, queue)
        return early_key

    def _release(self, placement: Any, clock: RequestClock) -> None:
        timing = clock.timing()  # TTFT concerns the prefill pool, ITL the decode pool: both get both
        for worker_id, pool in ((placement.prefill.worker_id, "prefill"), (placement.decode.worker_id, "decode")):
            self._finish(worker_id, timing, pool)

    def _end_attempt(self, placement: Any, clock: RequestClock, progress: RequestProgress, started: Any) -> None:
        self._release(placement, clock)
        if started and not progress.streamed:  # the early prefill was claimed if a token came; else drop it
            prefill_id = placement.prefill.worker_id
            self._send(lambda: self.prefill_pool.options(session_id=prefill_id).forget_prefill.remote(started))

    def _start_prefill(self, input_ids: List[int], params: Any, rid: str, prefill_id: str) -> str:
        """Start the prompt of attempt `rid` on its prefill replica (not awaited); returns the key its decode
        replica's prefill call claims it by, or "" when early_prefill is off."""
        if self.prefill_pool is None or params.n != 1:  # n > 1 is refused by the decode replica
            return ""
        key = f"{rid}.{uuid.uuid4().hex[:6]}"  # never twice, even for a rid a client reuses
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
