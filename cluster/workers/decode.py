"""DecodeWorker: a replica of the decode pool. It reserves pages for a prompt, has a prefill replica compute it
and write its KV here, then decodes and streams to the ingress like a unified worker (docs/disaggregation.md).

It is the handoff's receiver, the prefill replica its sender (docs/disaggregation.md, Vocabulary).

Failures: every wait is bounded (the prefill call by PREFILL_CALL_TIMEOUT_S, the transfer by
kv_transfer_timeout_s once the prompt is computed). Whatever fails, each engine frees its own pages — the
sender's hold is released in a `finally`, this receiver's reservation is aborted when its stream ends
early (engine.Engine.generate_stream) — and the request fails with PrefillFailedError before any token,
so the ingress may retry it on a new pair.
"""

import asyncio
import dataclasses
import logging
import pickle
import time
import uuid
from typing import Any, Dict, List, Optional

from cluster.kv_transfer import KVTransferTimeout, PeerInfo
from cluster.rpc import awaited, is_dead, unwrap
from cluster.workers.base import WorkerBase, WorkerItem, WrongReplicaError
from cluster.workers.handoff import PREFILL_CALL_TIMEOUT_S, PrefillFailedError, TransferTarget
from cluster.workers.kv_endpoint import KVEndpoint
from cluster.workers.stats import HandoffCounters
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")


class DecodeWorker(KVEndpoint, WorkerBase):
    """A replica of the decode pool: receives prompts' KV from prefill replicas and decodes."""

    async def __init__(
        self, model: Optional[str], engine_options: Dict[str, Any], prefill, kv_transfer: str, transfer_timeout_s: float
    ):
        WorkerBase.__init__(self, model, engine_options)
        self._init_transfer("decode", kv_transfer, transfer_timeout_s)
        self.prefill_pool = prefill
        """DeploymentHandle of the prefill pool (calls pinned by session_id)."""
        self._peers: Dict[str, PeerInfo] = {}
        self._handoff = HandoffCounters()
        """Sums so far, replaced (never mutated) on this replica's event loop; reported as they are."""
        self._calls: set = set()
        """Prefill calls not yet returned."""
        self._pumps: Dict[str, "asyncio.Task"] = {}
        """rid → the task moving its engine stream into its ingress's channel."""

    def _role_counters(self) -> HandoffCounters:
        return self._handoff

    async def submit_disaggregated(
        self,
        input_ids: List[int],
        params: SamplingParams,
        rid: str,
        prefill_id: str,
        early_key: str,
        ingress_id: str,
        replica_id: str,
    ) -> None:
        """Start a request whose prompt prefill replica `prefill_id` computes (started there by the ingress
        under `early_key`, if not ""); its outputs go to the stream of `ingress_id` (see WorkerBase). `rid` is
        the id of the ingress's attempt (each attempt has its own), which the prefill call carries too."""
        self._check_replica(replica_id)
        if self._aborted_before_submit(rid):
            return
        channel = self._channel(ingress_id)
        self._served.append(rid)
        arrived = time.perf_counter()

        async def remote_prefill(reservation):
            self._handoff = self._handoff.plus(reserve_s=time.perf_counter() - arrived)
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
                f"prefill replica {prefill_id} unreachable: {unwrap(exc)!r}", prefill_id, is_dead(unwrap(exc))
            ) from None
        transfer_id = f"{rid}/{uuid.uuid4().hex[:8]}"
        handle = self.transfer.expect(peer.name, reservation.dst_pages, transfer_id)
        target = TransferTarget(
            prefill_id, self.transfer.info(), reservation.prefix_len, reservation.dst_pages, transfer_id, early_key
        )
        call = self.prefill_pool.options(session_id=prefill_id).prefill.remote(
            input_ids, dataclasses.replace(params, seed=reservation.seed), rid, target
        )
        result = asyncio.ensure_future(awaited(call))
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
            cause = unwrap(exc)
            if is_dead(cause):
                self._peers.pop(prefill_id, None)
            raise PrefillFailedError(
                f"remote prefill on {prefill_id} failed: {cause!r}", prefill_id, is_dead(cause)
            ) from None
        self._handoff = self._handoff.plus(ready_s=time.perf_counter() - called, requests=1)
        return handoff

    async def _first_of(self, result: "asyncio.Future", arrival: "asyncio.Future", handle) -> Any:
        """The SenderHandoff, as soon as the KV has landed here and the handoff is known: from the
        message that came with the KV (usually), else from the prefill call's result. Raises what the
        call or the transfer raised."""
        done, _ = await asyncio.wait([result, arrival], return_when=asyncio.FIRST_COMPLETED)
        if arrival in done:
            arrival.result()  # raises if the transfer failed or timed out
            if handle.message:
                self._handoff = self._handoff.plus(notified=1)
                return pickle.loads(handle.message)  # the call returns later (_count_call)
            return (await asyncio.shield(result)).handoff  # shielded: a failure here settles the call first
        handoff = result.result().handoff  # raises if the call failed
        # The call returned first (the sender saw its write done): the completion notice is on its way.
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
        self._handoff = self._handoff.plus(
            calls=1,
            call_s=returned - called,
            prefill_compute_s=prefilled.compute_s,
            prefill_transfer_s=prefilled.transfer_s,
            call_out_s=prefilled.entered_at - called_at,
            call_back_s=returned_at - prefilled.left_at,
        )

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
