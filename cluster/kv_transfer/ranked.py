"""RankedTransfer: the KV transfer endpoint of a tensor-parallel replica — one backend per rank, each over its
own rank's KV pool shard (its own heads' K and V), moving the same page ids.

    prefill replica (TP=N)                                  decode replica (TP=N)
    rank 0: backend "<name>"          ── rank 0's heads ──▶ rank 0: backend "<name>"
    rank r: backend "<name>/rank<r>"  ── rank r's heads ──▶ rank r: backend "<name>/rank<r>"  (r = 1..N-1)

Rank 0's backend lives in this process (the worker's, beside the engine core's thread); rank r's in the
follower process of rank r (kv_transfer.rank_agent), driven from here through the engine's step channel
(Engine.call_other_ranks), so an op reaches rank r after the steps rank 0 sent before it. Rank r reports the
end of each of its transfers into the group's TCPStore; a handle here is DONE once rank 0's own handle is DONE
and every other rank reported b"ok" (its pages and, with rank 0's, the message have landed), FAILED when any
rank failed or died (the engine's TPGroup knows which). The peer description is a RankedPeerInfo, one PeerInfo
per rank: both sides must have the same tensor_parallel_size (connect refuses another one).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from cluster.kv_transfer import (
    KVTransferError,
    PeerInfo,
    TransferHandle,
    TransferStatus,
    kv_pool_buffers,
    make_backend,
)
from cluster.kv_transfer.base import Waitable, as_pages
from cluster.kv_transfer.rank_agent import info_key, status_key

START_TIMEOUT_S = 120.0
"""Bound on every other rank's backend start (NIXL agent, memory registration)."""
_AGENT_MODULE = "cluster.kv_transfer.rank_agent"


@dataclass(frozen=True)
class RankedPeerInfo:
    """What a peer needs to reach a tensor-parallel replica: one PeerInfo per rank, in rank order (picklable)."""

    ranks: Tuple[PeerInfo, ...]

    @property
    def name(self) -> str:
        """Rank 0's endpoint name: the replica's name for its peers."""
        return self.ranks[0].name


@dataclass(eq=False)
class RankedHandle:
    """One transfer on every rank: rank 0's handle here, the other ranks' reported through the store."""

    local: TransferHandle
    pending: List[int] = field(default_factory=list)
    """Ranks (1..N-1) that have not reported the end of their part yet."""
    error: Optional[str] = None
    released: bool = False

    @property
    def transfer_id(self) -> str:
        return self.local.transfer_id

    @property
    def peer(self) -> str:
        return self.local.peer

    @property
    def role(self) -> str:
        return self.local.role

    @property
    def message(self) -> bytes:
        """Rank 0's message (only rank 0's write carries one)."""
        return self.local.message


class RankedTransfer(Waitable):
    """A tensor-parallel replica's transfer endpoint over `engine` (its core in this process: Engine.runner);
    the interface of KVTransferBackend that the workers use (info, connect, write, expect, poll, release, wait,
    close), with RankedPeerInfo for PeerInfo and RankedHandle for TransferHandle."""

    def __init__(self, backend: str, name: str, engine: Any, page_size: int, start_timeout_s: float = START_TIMEOUT_S):
        import torch.distributed as dist  # noqa: PLC0415  (tensor parallelism only)

        runner = engine.runner
        self._engine, self._tp = engine, runner.tp
        self.size = self._tp.size
        self.local = make_backend(backend, name, kv_pool_buffers(runner.kv_pool), page_size)
        self.agent_name = name
        self._store = dist.TCPStore(
            "127.0.0.1", self._tp.store_port, is_master=False, timeout=timedelta(seconds=start_timeout_s)
        )
        self._peers: Dict[str, RankedPeerInfo] = {}
        try:
            self._call("start", backend, name, page_size)
            infos = [self.local.info()]
            for rank in range(1, self.size):
                self._store.wait([info_key(rank)], timedelta(seconds=start_timeout_s))
                info = pickle.loads(self._store.get(info_key(rank)))
                if isinstance(info, BaseException):
                    raise info
                infos.append(info)
        except BaseException:
            self.local.close()
            raise
        self._info = RankedPeerInfo(tuple(infos))

    def info(self) -> RankedPeerInfo:
        return self._info

    def connect(self, peer: Any) -> None:
        """Make `peer` (a RankedPeerInfo of a replica with as many ranks) known on every rank (idempotent)."""
        ranks = getattr(peer, "ranks", None)
        if ranks is None or len(ranks) != self.size:
            have = 1 if ranks is None else len(ranks)
            raise KVTransferError(
                f"peer {peer.name!r} has tensor_parallel_size {have}, this replica {self.size}: prefill and decode "
                "replicas must have the same tensor_parallel_size (KV moves rank to rank)"
            )
        known = self._peers.get(peer.name)
        if known is not None and [p.instance for p in known.ranks] == [p.instance for p in ranks]:
            return
        self.local.connect(ranks[0])
        self._call("connect", ranks)
        self._peers[peer.name] = peer

    def write(
        self, peer: str, src_pages: Any, dst_pages: Any, transfer_id: str, message: bytes = b"", src_ready: bool = False
    ) -> RankedHandle:
        """KVTransferBackend.write on every rank (rank 0's carries `message`); `src_ready` holds for rank 0 only:
        the other ranks' writes wait for their own queued work."""
        names = self._names(peer)
        handle = self.local.write(peer, src_pages, dst_pages, transfer_id, message=message, src_ready=src_ready)
        src, dst = as_pages(src_pages, "src_pages"), as_pages(dst_pages, "dst_pages")
        return self._spread(handle, "write", names, src, dst, transfer_id, False)

    def expect(self, peer: str, dst_pages: Any, transfer_id: str) -> RankedHandle:
        names = self._names(peer)
        handle = self.local.expect(peer, dst_pages, transfer_id)
        return self._spread(handle, "expect", names, as_pages(dst_pages, "dst_pages"), transfer_id)

    def poll(self, handle: RankedHandle) -> TransferStatus:
        """DONE once every rank's part is done; the other ranks are asked only once rank 0's part is."""
        if handle.released:
            raise KVTransferError(f"handle of transfer {handle.transfer_id!r} was already released")
        if handle.error is None and self._tp.failure is not None:
            handle.error = str(self._tp.failure)
        if handle.error is not None:
            return TransferStatus.FAILED
        status = self.local.poll(handle.local)
        if status is not TransferStatus.DONE:
            if status is TransferStatus.FAILED:
                handle.error = f"rank 0: {handle.local.error}"
            return status
        for rank in list(handle.pending):
            key = status_key(handle.role, handle.transfer_id, rank)
            if not self._store.check([key]):
                return TransferStatus.PENDING
            result = self._store.get(key)
            if result != b"ok":
                handle.error = f"rank {rank}: {result.decode(errors='replace')}"
                return TransferStatus.FAILED
            handle.pending.remove(rank)
        return TransferStatus.DONE

    def release(self, handle: RankedHandle) -> None:
        """Release every rank's part (a rank's unfinished transfer is cancelled). Idempotent."""
        if handle.released:
            return
        handle.released = True
        self.local.release(handle.local)
        try:
            self._call("release", handle.role, handle.transfer_id)
        except Exception:  # noqa: BLE001 - a dead engine: its ranks and their transfers are gone
            pass

    def close(self) -> None:
        self.local.close()
        try:
            self._call("stop")
        except Exception:  # noqa: BLE001 - a dead engine: its ranks are gone
            pass

    # ---- helpers
    def _names(self, peer: str) -> Tuple[str, ...]:
        if peer not in self._peers:
            raise KVTransferError(f"unknown peer {peer!r}: call connect() with its RankedPeerInfo first")
        return tuple(p.name for p in self._peers[peer].ranks)

    def _spread(self, handle: TransferHandle, op: str, *args: Any) -> RankedHandle:
        """`op` on ranks 1..N-1 for the transfer whose rank-0 part is `handle`."""
        ranked = RankedHandle(handle, list(range(1, self.size)))
        try:
            self._call(op, *(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a for a in args))
        except BaseException:
            ranked.released = True
            self.local.release(handle)
            raise
        return ranked

    def _call(self, op: str, *args: Any) -> None:
        self._engine.call_other_ranks(_AGENT_MODULE, "command", op, *args)
