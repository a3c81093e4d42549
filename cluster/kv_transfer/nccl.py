"""NcclBackend: KV pages over a 2-rank NCCL communicator per (sender, receiver) pair. GPU only.

Pairs are made on demand at connect(): the side whose name sorts first is rank 0 and hosts
the rendezvous (its TCPStore, address in PeerInfo.store_addr); both sides build a
ProcessGroupNCCL over a store prefix naming both instances and a generation. NCCL itself
creates the communicator at the pair's first transfer (≈0.5 s, both sides blocking in it).

    sender                                               receiver
    write(peer, src, dst, id, message)                   expect(peer, dst, id)
      runs = page_run_arrays(src, dst)                     poll: pop headers in order
      header {id, dst runs, message} ─▶ store queue ──────▶ match id → post the recvs
      one coalesced group: send buffer[b][src run]          one coalesced group: recv into
      for every buffer b and run ───────── NCCL ──────────▶ buffer[b][dst run]
      poll: work.is_completed()                            poll: work.is_completed()

NCCL matches sends and receives by order, so the receiver posts its receives in header order:
a header whose expect is not registered yet holds the ones behind it; one whose expect was
released is drained into scratch memory. An unfinished operation cannot be cancelled: releasing
it aborts the pair's communicator (every transfer on it fails) and tells the peer through the
pair's store, whose next poll or write aborts its side too; both sides then call connect()
again (same PeerInfo), which builds the next generation of the pair.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import numpy as np
import torch

from cluster.kv_transfer.base import KVTransferBackend, KVTransferError, PeerInfo, TransferHandle, TransferStatus

logger = logging.getLogger(__name__)
_STORE_CONNECT_TIMEOUT = timedelta(seconds=30)
_CANCELLED_TTL_S = 600.0
"""A header for a cancelled expect is expected within this long; later ones hold the queue."""


def default_host() -> str:
    """The address peers reach this process at: $RADIXSERVE_KV_HOST, else Ray's node IP, else the hostname's."""
    if os.environ.get("RADIXSERVE_KV_HOST"):
        return os.environ["RADIXSERVE_KV_HOST"]
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _succeeded(work: Any) -> bool:
    """Whether a completed Work succeeded. torch 2.11 cannot hand the exception itself to Python
    (Work.exception() raises TypeError); NCCL failures also abort the communicator, which the pair
    check reports."""
    try:
        return bool(work.is_success())
    except (TypeError, RuntimeError):
        return True


def _coalescing(pg: Any, method: str, device: torch.device) -> Any:
    """ProcessGroupNCCL's private coalescing hooks: torch releases differ on whether they take the
    device (torch 2.11's backend object takes none)."""
    fn = getattr(pg, method)
    try:
        return fn(device)
    except TypeError:
        return fn()


@dataclass
class _Expect:
    dst: np.ndarray
    work: Any = None
    """The coalesced receive, once its header arrived and it was posted."""


@dataclass
class _Pair:
    """This side of one pair's communicator."""

    peer: str
    rank: int
    generation: int
    store: Any
    pg: Any
    expects: dict[str, TransferHandle] = field(default_factory=dict)
    held: Optional[dict] = None
    """The oldest header whose expect is not registered yet (blocks the ones behind it)."""
    cancelled: dict[str, float] = field(default_factory=dict)
    """transfer_id → when its expect was released unposted (its header may still come)."""
    draining: list[tuple[Any, list[torch.Tensor]]] = field(default_factory=list)
    broken: Optional[str] = None
    checked_at: float = 0.0
    """When the pair's store was last asked whether the peer aborted the pair."""


class NcclBackend(KVTransferBackend):
    name = "nccl"

    def __init__(
        self,
        agent_name: str,
        buffers: Sequence[torch.Tensor],
        page_size: int,
        host: Optional[str] = None,
        nccl_timeout_s: float = 1800.0,
    ):
        """`nccl_timeout_s` bounds NCCL's own watchdog; keep it above every transfer timeout."""
        super().__init__(agent_name, buffers, page_size)
        import torch.distributed as dist

        self._dist = dist
        self._check_device()
        self.device = self.buffers[0].device
        self._timeout = timedelta(seconds=nccl_timeout_s)
        self._instance = uuid.uuid4().hex
        self._host = host or default_host()
        self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout)
        self._clients: dict[tuple[str, int], Any] = {}
        self._pairs: dict[str, _Pair] = {}
        self._generations: dict[str, int] = {}

    def _check_device(self) -> None:
        if not self.layout.device.startswith("cuda"):
            raise KVTransferError(
                f"the NCCL backend moves CUDA memory only; the KV buffers are on "
                f"{self.layout.device} (use the nixl backend for host memory)"
            )
        if not self._dist.is_available() or not self._dist.is_nccl_available():
            raise KVTransferError("this torch build has no NCCL support")

    def _make_process_group(self, store: Any, rank: int, group_name: str) -> Any:
        """The pair's 2-rank NCCL process group (communicator created lazily by NCCL)."""
        options = self._dist.ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        options.group_name = group_name
        return self._dist.ProcessGroupNCCL(store, rank, 2, options)

    def info(self) -> PeerInfo:
        return PeerInfo(
            name=self.agent_name,
            backend=self.name,
            layout=self.layout,
            instance=self._instance,
            store_addr=(self._host, self._store.port),
        )

    # ---- pairs
    def connect(self, peer: PeerInfo) -> None:
        """As the base class; an aborted pair (either side's abort) is rebuilt as its next generation."""
        pair = self._pairs.get(peer.name)
        same = pair is not None and self._peers[peer.name].instance == peer.instance
        if same and self._check_broken(pair, force=True) is not None:
            self._disconnect(self._peers[peer.name])  # next generation of the same pair
        super().connect(peer)

    def _connect(self, peer: PeerInfo) -> None:
        if not peer.store_addr[0]:
            raise KVTransferError(f"PeerInfo of {peer.name!r} has no rendezvous address")
        rank = 0 if self.agent_name < peer.name else 1
        store = self._store if rank == 0 else self._client(peer.store_addr)
        lo, hi = (self.info(), peer) if rank == 0 else (peer, self.info())
        generation = self._generations.get(peer.name, -1) + 1
        self._generations[peer.name] = generation
        prefix = f"kvx/{lo.name}:{lo.instance}/{hi.name}:{hi.instance}/{generation}"
        pair_store = self._dist.PrefixStore(prefix, store)
        pg = self._make_process_group(self._dist.PrefixStore("pg", pair_store), rank, prefix)
        self._pairs[peer.name] = _Pair(peer.name, rank, generation, pair_store, pg)

    def _client(self, addr: tuple[str, int]) -> Any:
        if addr not in self._clients:
            try:
                client = self._dist.TCPStore(addr[0], addr[1], is_master=False, timeout=_STORE_CONNECT_TIMEOUT)
            except Exception as e:
                raise KVTransferError(f"cannot reach the rendezvous store at {addr[0]}:{addr[1]}: {e}") from e
            client.set_timeout(self._timeout)  # NCCL's id exchange waits on it
            self._clients[addr] = client
        return self._clients[addr]

    def _disconnect(self, peer: PeerInfo) -> None:
        for handle in [h for h in self._live.values() if h.peer == peer.name]:
            self.release(handle)
        pair = self._pairs.pop(peer.name, None)
        if pair is not None and pair.broken is None:
            try:
                pair.pg.shutdown()
            except Exception as e:
                logger.warning("shutting down the NCCL pair with %r: %s", peer.name, e)
        self._peers.pop(peer.name, None)

    def _break(self, pair: _Pair, reason: str, tell_peer: bool = True) -> None:
        """Abort the pair's communicator and, through the pair's store, tell the peer to do the same."""
        if pair.broken is not None:
            return
        pair.broken = reason
        logger.warning("aborting the NCCL pair with %r: %s", pair.peer, reason)
        if tell_peer:
            try:
                pair.store.set("broken", f"{self.agent_name}: {reason}")
            except Exception as e:  # the peer (or the store's host) is gone
                logger.warning("could not tell %r that the pair is aborted: %s", pair.peer, e)
        pair.pg.abort()

    def _check_broken(self, pair: _Pair, force: bool = False) -> Optional[str]:
        """The pair's failure reason, learning (at most every 100 ms unless forced) whether the peer aborted it."""
        now = time.monotonic()
        if pair.broken is None and (force or now - pair.checked_at > 0.1):
            pair.checked_at = now
            try:
                if pair.store.check(["broken"]):
                    self._break(pair, f"aborted by {pair.store.get('broken').decode()}", tell_peer=False)
            except Exception as e:
                self._break(pair, f"the pair's rendezvous store is unreachable: {e}", tell_peer=False)
        return pair.broken

    # ---- transfers
    def _views(self, runs: Sequence[tuple[int, int]], buffer_ids: np.ndarray) -> list[torch.Tensor]:
        """Pages [start, start + length) of every (start, length) run of the given buffers, buffer-major:
        contiguous views."""
        ps = self.layout.page_size
        return [self.buffers[b][s * ps : (s + n) * ps] for b in buffer_ids.tolist() for s, n in runs]

    def _post(self, pair: _Pair, tensors: list[torch.Tensor], send: bool) -> Any:
        """One coalesced NCCL group of sends (or receives) of `tensors`, in order; returns its Work."""
        op = pair.pg.send if send else pair.pg.recv
        with torch.cuda.device(self.device):
            _coalescing(pair.pg, "_start_coalescing", self.device)
            for t in tensors:
                op([t], 1 - pair.rank, 0)
            return _coalescing(pair.pg, "_end_coalescing", self.device)

    def _start_write(
        self,
        handle: TransferHandle,
        peer: PeerInfo,
        src: np.ndarray,
        dst: np.ndarray,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        src_ready: bool,
    ) -> None:
        # src_ready changes nothing here: the process group's sends wait for the current stream's work anyway.
        pair = self._pairs[peer.name]
        if self._check_broken(pair) is not None:
            handle.error = f"the NCCL pair with {peer.name!r} was aborted ({pair.broken}); connect again"
            return
        src_starts, dst_starts, lengths = (r.tolist() for r in runs)
        header = {
            "id": handle.transfer_id,
            "runs": [list(r) for r in zip(dst_starts, lengths)],
            "buffers": handle.buffer_ids.tolist(),
            "message": base64.b64encode(handle.message).decode(),
        }
        tensors = self._views(list(zip(src_starts, lengths)), handle.buffer_ids)
        try:
            pair.store.queue_push(f"hdr/{self.agent_name}", json.dumps(header))
            handle.state = self._post(pair, tensors, send=True)
        except Exception as e:  # the peer may have its header but not our sends: the order is lost
            handle.error = f"posting the NCCL sends failed: {type(e).__name__}: {e}"
            self._break(pair, handle.error)

    def _start_expect(self, handle: TransferHandle, dst: np.ndarray) -> None:
        pair = self._pairs[handle.peer]
        handle.state = _Expect(dst)
        pair.cancelled.pop(handle.transfer_id, None)
        pair.expects[handle.transfer_id] = handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self._check_live(handle)
        pair = self._pairs.get(handle.peer)
        if handle.error is None and pair is not None and self._check_broken(pair) is not None:
            handle.error = f"the NCCL pair with {handle.peer!r} was aborted ({pair.broken}); connect again"
        if handle.error is not None:
            return TransferStatus.FAILED
        if handle.role == "expect":
            try:
                self._drain_headers(pair)
            except Exception as e:  # the store or NCCL failed mid-way: the order is lost
                self._break(pair, f"receiving failed: {type(e).__name__}: {e}")
                handle.error = handle.error or pair.broken
            if handle.error is not None:
                return TransferStatus.FAILED
            work = handle.state.work
        else:
            work = handle.state
        if work is None or not work.is_completed():
            return TransferStatus.PENDING
        if not _succeeded(work):
            handle.error = "NCCL reported a failed operation"
            return TransferStatus.FAILED
        return TransferStatus.DONE

    def _drain_headers(self, pair: _Pair) -> None:
        """Post receives for every arrived header, in order, as far as their expects are registered."""
        pair.draining = [(w, ts) for w, ts in pair.draining if not w.is_completed()]
        key = f"hdr/{pair.peer}"
        while pair.broken is None:
            if pair.held is None:
                if pair.store.queue_len(key) == 0:
                    return
                pair.held = json.loads(pair.store.queue_pop(key, False))
            header = pair.held
            runs = np.array(header["runs"], dtype=np.int64).reshape(-1, 2)
            buffer_ids = np.array(header["buffers"], dtype=np.int64)
            handle = pair.expects.get(header["id"])
            if handle is None and header["id"] not in pair.cancelled:
                return  # its expect may still come; later headers wait behind it
            pair.held = None
            if handle is None:
                pair.cancelled.pop(header["id"], None)
                self._drain_to_scratch(pair, runs, buffer_ids)
                continue
            del pair.expects[header["id"]]
            sent_dst = np.concatenate([np.arange(s, s + n) for s, n in runs]) if len(runs) else runs[:, 0]
            if not (np.array_equal(sent_dst, handle.state.dst) and np.array_equal(buffer_ids, handle.buffer_ids)):
                handle.error = "the sender's dst pages or buffers differ from the expected ones"
                self._drain_to_scratch(pair, runs, buffer_ids)
                continue
            handle.state.work = self._post(pair, self._views(runs.tolist(), buffer_ids), send=False)
            handle.message = base64.b64decode(header.get("message", ""))  # read by the caller once DONE

    def _drain_to_scratch(self, pair: _Pair, runs: np.ndarray, buffer_ids: np.ndarray) -> None:
        """Receive a transfer nobody wants into temporary memory, keeping the NCCL order intact."""
        tensors = [torch.empty_like(view) for view in self._views(runs.tolist(), buffer_ids)]
        pair.draining.append((self._post(pair, tensors, send=False), tensors))

    def _release(self, handle: TransferHandle) -> None:
        pair = self._pairs.get(handle.peer)
        if pair is None or pair.broken is not None:
            return
        if handle.role == "expect":
            pair.expects.pop(handle.transfer_id, None)
            work = handle.state.work if isinstance(handle.state, _Expect) else None
            if work is None:
                if handle.error is None:
                    now = time.monotonic()
                    pair.cancelled = {k: t for k, t in pair.cancelled.items() if now - t < _CANCELLED_TTL_S}
                    pair.cancelled[handle.transfer_id] = now
                return
        else:
            work = handle.state
        if work is not None and not work.is_completed():
            self._break(pair, f"transfer {handle.transfer_id!r} was released unfinished")
