"""Disaggregated serving: the Prefill and Decode pools and the ingress backend that pairs them.

One request (docs/disaggregation.md):

    Ingress (DisaggregatedBackend)
      1. Router.route_pair(input_ids) ─▶ PairDecision(prefill replica, decode replica)
      2. PrefillWorker.start_prefill(input_ids, params, rid, key), pinned, not awaited (early_prefill):
           the engine starts computing the prompt now; the result waits on the replica under `key`
      3. DecodeWorker.submit_disaggregated(input_ids, params, rid, prefill_id, key, ...), pinned:
           engine reserves destination pages (after matching its own radix cache) ─▶ KVReservation
           expect(prefill peer, dst pages, transfer id)                       (cluster.kv_transfer)
           PrefillWorker.prefill(input_ids, params + seed, rid, TransferTarget), pinned:
               claims the prompt started under the target's key (else starts it now): the engine
               computes the prompt (own radix cache), samples the first token, holds the KV
               write(src pages of [prefix_len, prompt_len) ─▶ dst pages, message = the PrefillHandoff
               (first token, logprobs)); wait; release the hold; return it (and its timings)
           the transfer arrives with the handoff (usually before the call returns: go on then; a
           handoff too large for a message comes with the call's result); the engine appends the
           first token and decodes
         ◀── StreamOutputs of token ids on the ingress's batched stream from the decode replica
             (cluster.worker: one message per engine step for all its requests); the ingress makes
             the text (engine/text.py)
      4. Router.finish for both replicas

Why step 2: the decode replica's reservation and its call to the prefill replica take ~6 ms (2× H200)
before the prompt starts; started by the ingress, the prompt computes meanwhile. The decode replica
still owns the handoff (its prefill call claims the started prompt), so the failure handling below is
unchanged. A started prompt nobody claims (the request ended first, or a retry moved it) is dropped:
by the ingress's forget_prefill, else after kv_transfer_timeout_s. Both calls carry the same seed
(the ingress draws one when the request has none), so the first token is sampled as in unified mode.

Failures: every wait is bounded (kv_transfer_timeout_s, the prefill call's own bound). Whatever
fails, each engine frees its own pages — the prefill side's hold is released in a `finally`, the
decode side's reservation is aborted when its stream ends early (engine.Engine.generate_stream).
A failure before any token reached the client (prefill replica death, decode replica death,
transfer failure or timeout) is retried on a new pair, up to MAX_ATTEMPTS; dead replicas are
reported to the router first so that the new pair avoids them. Later failures reach the client.
"""

import asyncio
import dataclasses
import logging
import pickle
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional

import numpy as np
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.early_prefill import StartedPrompts
from cluster.ingress import ClusterBackend, RequestProgress, _awaited, _unwrap
from cluster.kv_transfer import MAX_MESSAGE_BYTES, KVTransferTimeout, PeerInfo, kv_pool_buffers, make_backend
from cluster.latency import RequestClock
from cluster.worker import WorkerBase, WorkerItem, WrongReplicaError
from engine.text import OutputText

logger = logging.getLogger("ray.serve")

MAX_ATTEMPTS = 3
"""Tries per request (first + retries) while nothing has been streamed."""
PREFILL_CALL_TIMEOUT_S = 600.0
"""Bound on one prefill call (queueing + compute + transfer)."""


class PrefillFailedError(RuntimeError):
    """The remote prefill of a request failed (the prefill replica died, refused, or the transfer failed
    or timed out). Raised by the decode replica before any token was produced, so the request may be
    retried. `prefill_dead`: the prefill replica is gone."""

    def __init__(self, message: str, prefill_id: str, prefill_dead: bool):
        super().__init__(message)
        self.prefill_id, self.prefill_dead = prefill_id, prefill_dead

    def __reduce__(self):
        return (PrefillFailedError, (str(self), self.prefill_id, self.prefill_dead))


@dataclass(frozen=True)
class TransferTarget:
    """Decode side → prefill side: where and how to write the prompt's KV."""

    replica_id: str
    """The prefill replica the decode side expects to write (refused by any other)."""
    peer: PeerInfo
    """The decode replica's transfer endpoint."""
    prefix_len: int
    """Positions [0, prefix_len) are cached on the decode side; [prefix_len, prompt_len) are written."""
    dst_pages: np.ndarray
    """(pages,) int64 decode-pool page ids of positions [prefix_len, prompt_len)."""
    transfer_id: str
    early_key: str = ""
    """The key under which the ingress started this prompt on the prefill replica ("" if it did not)."""


@dataclass(frozen=True)
class PrefillResult:
    """Prefill side → decode side: the engine's PrefillHandoff and where the prefill call's time went."""

    handoff: Any
    """engine.scheduler.handoff.PrefillHandoff (first token, logprobs)."""
    compute_s: float
    """Queueing and computing the prompt in the prefill engine, from the call's arrival (a prompt the
    ingress started earlier counts only its part after that)."""
    transfer_s: float
    """Writing the KV into the decode replica's pages, until the writer's handle is done."""
    entered_at: float
    left_at: float
    """Wall clock (time.time()) when the call started and ended on the prefill replica: with the decode
    side's own clock they split the call's transport time into out and back (exact on one host, to NTP
    accuracy across hosts)."""


HANDOFF_COUNTERS = (
    "handoff_requests",
    "handoff_notified",
    "handoff_reserve_s",
    "handoff_ready_s",
    "handoff_calls",
    "handoff_call_s",
    "handoff_prefill_compute_s",
    "handoff_prefill_transfer_s",
    "handoff_call_out_s",
    "handoff_call_back_s",
)
"""Decode replicas' handoff counters (sums, in the stats they report). Per successful handoff
(handoff_requests): request arrival → pages reserved (reserve); prefill call made → first token and KV
here (ready: the critical path; handoff_notified counts those that went on when the KV's completion
notice brought the handoff, before the call returned). Per returned prefill call (handoff_calls): the
call (compute + transfer + call overheads), and of it the transport out (call made → running on the
prefill replica) and back (returned there → result here). Overhead over a unified TTFT ≈ reserve +
ready − compute."""


def handoff_message(handoff: Any) -> bytes:
    """The PrefillHandoff as the message that travels with its KV (without the source page ids, which only
    the prefill side needs), so that the decode side can go on as soon as the bytes have landed instead of
    when the prefill call returns; b"" when it does not fit one (large prompt_logprobs): the decode side
    then takes the handoff from the call's result."""
    message = pickle.dumps(dataclasses.replace(handoff, src_pages=np.empty(0, dtype=np.int64)))
    return message if len(message) <= MAX_MESSAGE_BYTES else b""


def _is_dead(exc: BaseException) -> bool:
    return isinstance(exc, (ActorDiedError, ActorUnavailableError))


class _KVEndpoint:
    """Mixin: a worker replica's KV transfer backend over its engine's KV pool."""

    def _init_transfer(self, role: str, backend: str, timeout_s: float) -> None:
        runner = self.engine.runner
        self.transfer_timeout_s = timeout_s
        self.transfer = make_backend(
            backend, f"{role}-{self.replica_id}", kv_pool_buffers(runner.kv_pool), self.engine.config.page_size
        )

    async def kv_info(self) -> PeerInfo:
        """This replica's transfer endpoint (PeerInfo)."""
        return self.transfer.info()


class PrefillWorker(_KVEndpoint, WorkerBase):
    """A replica of the prefill pool: computes prompts and writes their KV into decode replicas."""

    async def __init__(
        self, model: Optional[str], engine_options: Dict[str, Any], kv_transfer: str, transfer_timeout_s: float
    ):
        WorkerBase.__init__(self, model, engine_options)
        self._init_transfer("prefill", kv_transfer, transfer_timeout_s)
        self.started = StartedPrompts(self.engine, self.engine.runner.kv_pool.num_slots // 2, transfer_timeout_s)
        """Prompts the ingress started here (early_prefill), at most half the KV pool's tokens."""

    def _extra_stats(self) -> Dict[str, float]:
        return {**super()._extra_stats(), **self.started.stats()}

    async def start_prefill(self, input_ids: List[int], params: Any, rid: str, key: str, replica_id: str) -> None:
        """Start computing a prompt that a decode replica's prefill call will claim under `key` (returns at
        once; see cluster.early_prefill). Ignored when meant for another replica."""
        if replica_id == self.replica_id:
            self.started.start(input_ids, params, key)

    async def forget_prefill(self, key: str) -> None:
        """The request of `key` ended without its prompt being claimed: drop it (no-op once claimed)."""
        self.started.forget(key)

    async def prefill(self, input_ids: List[int], params: Any, rid: str, target: TransferTarget) -> Any:
        """Compute the prompt (or claim the one the ingress started under target.early_key), write the KV of
        [target.prefix_len, prompt_len) into target.dst_pages, and return a PrefillResult with the engine's
        PrefillHandoff (first token and logprobs). The hold on this replica's pages is released whatever
        happens."""
        if target.replica_id != self.replica_id:
            raise WrongReplicaError(
                f"prefill for {rid} was meant for replica {target.replica_id}, reached {self.replica_id}"
            )
        entered_at = time.time()
        self._served.append(rid)
        self.transfer.connect(target.peer)
        start = time.perf_counter()
        started = self.started.claim(target.early_key, input_ids, params) if target.early_key else None
        if started is not None:
            engine_rid = started.engine_rid
            handoff = await started.task  # cancelling this call cancels the task: the engine aborts it
        else:
            engine_rid = f"{target.early_key}~" if target.early_key else rid  # never an unclaimed one's rid
            handoff = await self.engine.prefill_for_handoff(input_ids, params, rid=engine_rid)
        computed = time.perf_counter()
        try:
            src = handoff.pages_from(target.prefix_len)
            # src_ready: the first token is on the host, so the kernels that wrote these pages are done (a CUDA
            # event on this thread's stream would also wait for whatever the engine queued since).
            handle = self.transfer.write(
                target.peer.name,
                src,
                target.dst_pages,
                target.transfer_id,
                message=handoff_message(handoff),
                src_ready=True,
            )
            await self.transfer.wait(handle, self.transfer_timeout_s)
        finally:
            self.engine.release_handoff(engine_rid)
        return PrefillResult(handoff, computed - start, time.perf_counter() - computed, entered_at, time.time())


class DecodeWorker(_KVEndpoint, WorkerBase):
    """A replica of the decode pool: receives prompts' KV from prefill replicas and decodes."""

    async def __init__(
        self, model: Optional[str], engine_options: Dict[str, Any], prefill, kv_transfer: str, transfer_timeout_s: float
    ):
        WorkerBase.__init__(self, model, engine_options)
        self._init_transfer("decode", kv_transfer, transfer_timeout_s)
        self.prefill_pool = prefill
        """DeploymentHandle of the prefill pool (calls pinned by session_id)."""
        self._peers: Dict[str, PeerInfo] = {}
        self._handoff = dict.fromkeys(HANDOFF_COUNTERS, 0.0)
        self._calls: set = set()
        """Prefill calls not yet returned."""
        self._pumps: Dict[str, "asyncio.Task"] = {}
        """rid → the task moving its engine stream into its ingress's channel."""

    def _extra_stats(self) -> Dict[str, float]:
        return {**super()._extra_stats(), **self._handoff}

    async def submit_disaggregated(
        self,
        input_ids: List[int],
        params: Any,
        rid: str,
        prefill_id: str,
        early_key: str,
        ingress_id: str,
        replica_id: str,
    ) -> None:
        """Start a request whose prompt prefill replica `prefill_id` computes (started there by the ingress
        under `early_key`, if not ""); its outputs go to the stream of `ingress_id` (see WorkerBase)."""
        self._check_replica(replica_id)
        if self._aborted_before_submit(rid):
            return
        channel = self._channel(ingress_id)
        self._served.append(rid)
        arrived = time.perf_counter()

        async def remote_prefill(reservation):
            self._handoff["handoff_reserve_s"] += time.perf_counter() - arrived
            return await self._remote_prefill(input_ids, params, rid, prefill_id, reservation, early_key)

        async def pump() -> None:
            first = True
            try:
                async for out in self.engine.generate_stream(input_ids, params, rid=rid, remote_prefill=remote_prefill):
                    if first:
                        first = False
                        self._count_first_output(arrived)
                    channel.put(WorkerItem(rid, output=out))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the ingress retries or reports it
                channel.put(WorkerItem(rid, error=exc))
            finally:
                channel.rids.discard(rid)
                self._pumps.pop(rid, None)

        channel.rids.add(rid)
        self._pumps[rid] = asyncio.ensure_future(pump())

    def abort(self, rid: str, replica_id: Optional[str] = None) -> None:
        """Abort request (or choice) `rid` here: its stream stops, the engine frees its pages (see
        WorkerBase.abort)."""
        if replica_id is not None and replica_id != self.replica_id:
            return
        pump = self._pumps.pop(rid, None)
        if pump is not None:
            pump.cancel()  # generate_stream's end aborts the request (and a remote prefill in flight)
        super().abort(rid)

    async def _remote_prefill(self, input_ids, params, rid: str, prefill_id: str, reservation, early_key: str) -> Any:
        try:
            peer = await self._prefill_peer(prefill_id)
        except Exception as exc:  # noqa: BLE001 - becomes a retryable error
            raise PrefillFailedError(
                f"prefill replica {prefill_id} unreachable: {_unwrap(exc)!r}", prefill_id, _is_dead(_unwrap(exc))
            ) from None
        transfer_id = f"{rid}/{uuid.uuid4().hex[:8]}"
        handle = self.transfer.expect(peer.name, reservation.dst_pages, transfer_id)
        target = TransferTarget(
            prefill_id, self.transfer.info(), reservation.prefix_len, reservation.dst_pages, transfer_id, early_key
        )
        call = self.prefill_pool.options(session_id=prefill_id).prefill.remote(
            input_ids, dataclasses.replace(params, seed=reservation.seed), rid, target
        )
        result = asyncio.ensure_future(_awaited(call))
        called, called_at = time.perf_counter(), time.time()
        result.add_done_callback(lambda done: self._count_call(done, called, called_at))
        self._calls.add(result)  # it may outlive this coroutine (the KV's notice came first)
        result.add_done_callback(self._calls.discard)
        # The KV arrives once the prefill replica has queued and computed the prompt, which takes as long as
        # its load says: the whole wait is bounded like the call; transfer_timeout_s bounds the transfer only
        # (from the call's return, which comes after the prefill replica's own write is done, see _first_of).
        arrival = asyncio.ensure_future(self.transfer.wait(handle, PREFILL_CALL_TIMEOUT_S))
        try:
            handoff = await asyncio.wait_for(self._first_of(result, arrival, handle), PREFILL_CALL_TIMEOUT_S)
        except BaseException as exc:
            arrival.cancel()
            self.transfer.release(handle)
            if not result.done():
                # The prefill may still be writing into our pages: they are freed (by the engine's
                # abort, once this raises) only after it let go of them — its own transfer wait is
                # bounded by the same timeout.
                call.cancel()
                await self._settle(result)
            if isinstance(exc, asyncio.CancelledError):
                raise
            cause = _unwrap(exc)
            if _is_dead(cause):
                self._peers.pop(prefill_id, None)
            raise PrefillFailedError(
                f"remote prefill on {prefill_id} failed: {cause!r}", prefill_id, _is_dead(cause)
            ) from None
        self._handoff["handoff_ready_s"] += time.perf_counter() - called
        self._handoff["handoff_requests"] += 1
        return handoff

    async def _first_of(self, result: "asyncio.Future", arrival: "asyncio.Future", handle) -> Any:
        """The PrefillHandoff, as soon as the KV has landed here and the handoff is known: from the
        message that came with the KV (usually), else from the prefill call's result. Raises what the
        call or the transfer raised."""
        done, _ = await asyncio.wait([result, arrival], return_when=asyncio.FIRST_COMPLETED)
        if arrival in done:
            arrival.result()  # raises if the transfer failed or timed out
            if handle.message:
                self._handoff["handoff_notified"] += 1
                return pickle.loads(handle.message)  # the call returns later (_count_call)
            return (await asyncio.shield(result)).handoff  # shielded: a failure here settles the call first
        handoff = result.result().handoff  # raises if the call failed
        # The call returned first (the writer saw its write done): the completion notice is on its way.
        done, _ = await asyncio.wait([arrival], timeout=self.transfer_timeout_s)
        if not done:
            raise KVTransferTimeout(
                f"transfer {handle.transfer_id!r}: the prefill replica wrote it, but its "
                f"completion notice did not come in {self.transfer_timeout_s:.3g} s"
            )
        arrival.result()
        return handoff

    def _count_call(self, result: "asyncio.Future", called: float, called_at: float) -> None:
        """When a prefill call returns: add its times to the counters (failures are handled elsewhere)."""
        if result.cancelled() or result.exception() is not None:
            return
        returned, returned_at, prefilled = time.perf_counter(), time.time(), result.result()
        for key, seconds in (
            ("handoff_call_s", returned - called),
            ("handoff_prefill_compute_s", prefilled.compute_s),
            ("handoff_prefill_transfer_s", prefilled.transfer_s),
            ("handoff_call_out_s", prefilled.entered_at - called_at),
            ("handoff_call_back_s", returned_at - prefilled.left_at),
        ):
            self._handoff[key] += seconds
        self._handoff["handoff_calls"] += 1

    async def _settle(self, result: "asyncio.Future") -> None:
        """Wait (bounded) until a cancelled prefill call has finished, whatever its outcome."""
        bound = self.transfer_timeout_s + 5.0
        done, _ = await asyncio.wait([result], timeout=bound)
        if not done:
            logger.warning("a cancelled prefill call did not settle in %.0f s", bound)
        elif not result.cancelled():
            result.exception()  # retrieved: no "exception was never retrieved" warning

    async def _prefill_peer(self, prefill_id: str) -> PeerInfo:
        peer = self._peers.get(prefill_id)
        if peer is None:
            peer = await asyncio.wait_for(self.prefill_pool.options(session_id=prefill_id).kv_info.remote(), 60)
            if not peer.name.endswith(prefill_id):
                raise WrongReplicaError(f"asked prefill replica {prefill_id} for its endpoint, {peer.name} answered")
            self.transfer.connect(peer)
            self._peers[prefill_id] = peer
        return peer


class DisaggregatedBackend(ClusterBackend):
    """The ingress backend of mode=disaggregated: `workers` is the decode pool's handle; with `prefill`
    (the prefill pool's handle) each prompt starts on its prefill replica when the request arrives."""

    def __init__(self, *args: Any, prefill: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prefill_pool = prefill

    async def generate_stream(self, input_ids: List[int], params: Any, rid: str) -> AsyncIterator[Any]:
        if self.prefill_pool is not None and params.seed is None:  # both replicas must sample alike
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        for attempt in range(1, MAX_ATTEMPTS + 1):
            text = OutputText(self.tokenizer, input_ids, params)
            pair = await self._ask_router(
                self.router.route_pair.remote(input_ids, rid), lambda late: self._finish_pair(late, RequestClock())
            )
            progress, clock = RequestProgress(params.n), RequestClock()
            decode_id = pair.decode.worker_id
            early_key = self._start_prefill(input_ids, params, rid, pair.prefill.worker_id, attempt)
            queue = self._open(decode_id, rid)
            self._on_failure(
                self.workers.options(session_id=decode_id).submit_disaggregated.remote(
                    input_ids, params, rid, pair.prefill.worker_id, early_key, self.ingress_id, decode_id
                ),
                rid,
                queue,
            )
            try:
                async for out in self._outputs(queue, text, decode_id, rid, params.n, clock, progress):
                    yield out
                return
            except Exception as exc:  # noqa: BLE001 - retried before the first token, else raised
                cause = _unwrap(exc)
                retry = (
                    not progress.streamed
                    and attempt < MAX_ATTEMPTS
                    and (isinstance(cause, (PrefillFailedError, WrongReplicaError)) or _is_dead(cause))
                )
                await self._report_failure(pair, cause)
                if not retry:
                    raise cause from None
                logger.warning(
                    "request %s: attempt %d failed before streaming (%r); retrying on a new pair", rid, attempt, cause
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
        elif _is_dead(cause):
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
