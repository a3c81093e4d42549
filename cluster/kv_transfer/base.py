"""The KV transfer contract: layout, peer description, handles, errors, and the backend ABC.

A replica's KV memory is `num_buffers` contiguous tensors of identical shape (num_slots, ...): for the
engine's token-major KVPool it is ONE buffer, (num_slots, values per token) — every layer's K and V of a
slot side by side (`kv_pool_buffers`). Page p is slots [p*page_size, (p+1)*page_size), i.e. bytes
[p*page_bytes, (p+1)*page_bytes) of EVERY buffer.
Page 0 is reserved by the engine (padding sink) and is never transferred.

A handoff moves src pages of the sender (prefill) into dst pages of the receiver (decode),
pairwise (src_pages[i] → dst_pages[i]) in every buffer. Runs of pages consecutive on both
sides travel as one region per buffer per run (`page_runs`).

Ownership: the pages on both sides belong to their engines. A backend never frees pages. A
transfer that failed or timed out leaves the dst pages' contents undefined; the receiver may
reuse them only once the sender released its write handle (or is known to be dead): a sender
still running could otherwise land data in pages that were handed to another request.
Registered buffers must stay where they are: never pickle them through torch.multiprocessing
(it moves a CPU tensor's storage into shared memory, away from the registered address).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch


class KVTransferError(RuntimeError):
    """Bad input (page ids, layouts, unknown peers) or a transfer that failed."""


class KVTransferTimeout(KVTransferError):
    """A transfer did not finish within its bound; its handle has been released."""


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class KVLayout:
    """The shape of one replica's KV memory as a transfer sees it (picklable).

    Two sides are compatible when everything but `num_pages` and the device matches.
    """

    num_buffers: int
    """Number of registered buffers (1 for the engine's token-major KVPool)."""
    num_pages: int
    """Pages per buffer (page 0 included, never transferred)."""
    page_size: int
    """Tokens (slots) per page."""
    page_bytes: int
    """Bytes of one page in one buffer: page_size × num_kv_heads × head_dim × element size."""
    dtype: str
    """Element type of the buffers, e.g. "torch.bfloat16"."""
    device: str
    """"cpu" or "cuda:<index>" (the index as the owning process numbers its devices)."""

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor], page_size: int) -> "KVLayout":
        """Validate `buffers` (same shape/dtype/device, contiguous, num_slots divisible by page_size)."""
        if not buffers:
            raise KVTransferError("no KV buffers given")
        if page_size < 1:
            raise KVTransferError(f"page_size must be >= 1, got {page_size}")
        first = buffers[0]
        for i, buf in enumerate(buffers):
            if (buf.shape, buf.dtype, buf.device) != (first.shape, first.dtype, first.device):
                raise KVTransferError(
                    f"buffer {i} is {tuple(buf.shape)} {buf.dtype} on {buf.device}; buffer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: all must match"
                )
            if not buf.is_contiguous():
                raise KVTransferError(f"buffer {i} is not contiguous")
        num_slots = first.shape[0]
        if num_slots % page_size or num_slots < 2 * page_size:
            raise KVTransferError(
                f"num_slots={num_slots} must be a multiple of page_size={page_size} holding at least 2 pages"
            )
        page_bytes = first[:page_size].numel() * first.element_size()
        return cls(
            num_buffers=len(buffers),
            num_pages=num_slots // page_size,
            page_size=page_size,
            page_bytes=page_bytes,
            dtype=str(first.dtype),
            device=str(first.device),
        )

    def check_compatible(self, other: "KVLayout", peer: str) -> None:
        """Raise KVTransferError naming every field in which `other` (peer's layout) differs."""
        diffs = [
            f"{name}: local {getattr(self, name)!r} vs peer {getattr(other, name)!r}"
            for name in ("num_buffers", "page_size", "page_bytes", "dtype")
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise KVTransferError(f"KV layout of peer {peer!r} does not match: " + "; ".join(diffs))


@dataclass(frozen=True)
class PeerInfo:
    """What a peer needs to reach this backend (picklable: travels through Ray calls).

    `instance` changes whenever a backend is re-created under the same name, so a peer that
    reconnects is told apart from the one it replaced.
    """

    name: str
    backend: str
    """Registry name of the backend that produced it ("nixl" | "nccl")."""
    layout: KVLayout
    instance: str
    buffer_addrs: Tuple[int, ...] = ()
    """nixl: base address of every buffer, in buffer order."""
    agent_metadata: bytes = b""
    """nixl: the agent's metadata (`get_agent_metadata()`)."""
    store_addr: Tuple[str, int] = ("", 0)
    """nccl: host and port of this side's TCPStore (rendezvous for pairs it leads)."""


@dataclass(frozen=True)
class PageRun:
    """`length` pages src_start.. (sender) → dst_start.. (receiver), consecutive on both sides."""

    src_start: int
    dst_start: int
    length: int


def as_pages(pages: Any, name: str) -> np.ndarray:
    """Page ids (list, tuple, numpy or torch) → (n,) int64 numpy array; rejects non-integer input."""
    arr = pages.detach().cpu().numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages)
    if arr.ndim != 1:
        raise KVTransferError(f"{name} must be a 1-D list of page ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise KVTransferError(f"{name} must hold integers, got {arr.dtype}")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def check_pages(pages: np.ndarray, num_pages: int, name: str, *, unique: bool) -> None:
    """Every id in [1, num_pages) (page 0 is reserved), non-empty, and distinct when `unique`.

    On a handoff's critical path (a few numpy calls each cost microseconds): bounds from min/max, and
    distinctness from a strictly increasing order (the allocator's usual output) before any sort."""
    if pages.size == 0:
        raise KVTransferError(f"{name} is empty: a transfer moves at least one page")
    increasing = _increasing(pages)
    low, high = (pages[0], pages[-1]) if increasing else (pages.min(), pages.max())
    if low < 1 or high >= num_pages:
        bad = pages[(pages < 1) | (pages >= num_pages)]
        raise KVTransferError(
            f"{name} holds page ids outside [1, {num_pages}) (page 0 is reserved): {bad[:8].tolist()}"
        )
    if unique and not increasing and np.unique(pages).size != pages.size:
        raise KVTransferError(f"{name} holds duplicate page ids")


def _increasing(pages: np.ndarray) -> bool:
    """Strictly increasing (one vector comparison; a single page counts)."""
    return pages.size < 2 or bool((pages[1:] > pages[:-1]).all())


def page_run_arrays(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairing src_pages[i] → dst_pages[i] as maximal runs consecutive on both sides: (src starts,
    dst starts, lengths), each (runs,) int64."""
    if src_pages.shape != dst_pages.shape:
        raise KVTransferError(f"src_pages ({src_pages.size}) and dst_pages ({dst_pages.size}) differ in length")
    n = src_pages.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    # One run on both sides, the usual handoff (fresh pages at both ends): strictly increasing ids that
    # span exactly n values are consecutive. Two vector comparisons instead of the general path's ~10 calls.
    if (
        src_pages[-1] - src_pages[0] == n - 1
        and dst_pages[-1] - dst_pages[0] == n - 1
        and _increasing(src_pages)
        and _increasing(dst_pages)
    ):
        return src_pages[:1], dst_pages[:1], np.array([n], dtype=np.int64)
    # slicing, not np.diff: fewer calls on the handoff's critical path
    breaks = np.flatnonzero((src_pages[1:] - src_pages[:-1] != 1) | (dst_pages[1:] - dst_pages[:-1] != 1)) + 1
    bounds = np.concatenate(([0], breaks, [src_pages.size]))
    starts = bounds[:-1]
    return src_pages[starts], dst_pages[starts], bounds[1:] - starts


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> list[PageRun]:
    """Split the pairing src_pages[i] → dst_pages[i] into maximal runs consecutive on both sides."""
    src, dst, lengths = page_run_arrays(src_pages, dst_pages)
    return [PageRun(s, d, n) for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist())]


def transfer_digest(dst_pages: np.ndarray, buffer_ids: np.ndarray) -> int:
    """A checksum of (dst pages, buffer ids): both sides compare it to catch a sender/receiver mix-up."""
    return zlib.crc32(
        np.ascontiguousarray(dst_pages, dtype=np.int64).tobytes()
        + b"|"
        + np.ascontiguousarray(buffer_ids, dtype=np.int64).tobytes()
    )


MAX_MESSAGE_BYTES = 64 * 1024
"""Largest message a write carries to the receiver (a handoff's first token and logprobs fit easily)."""


@dataclass(eq=False)
class TransferHandle:
    """One side of one transfer, owned by the backend that made it (not picklable).

    Every handle must be released (`release`, or `wait`, which always releases it).
    """

    transfer_id: str
    peer: str
    role: str
    """"write" (sender side) or "expect" (receiver side)."""
    num_pages: int
    nbytes: int
    """Payload bytes: num_pages × page_bytes × len(buffer_ids)."""
    buffer_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """(num_buffers,) int64: the buffers this transfer moves (all of them)."""
    started: float = field(default_factory=time.monotonic)
    error: Optional[str] = None
    """Why the transfer failed (set when poll returns FAILED)."""
    message: bytes = b""
    """Sender: the bytes sent with the transfer's completion notice. Receiver: the bytes that came
    with it, set once poll returns DONE (and kept after release)."""
    released: bool = False
    state: Any = None
    """Backend-private state (native handles, works)."""


def poll_delay(previous_s: float, waited_s: float) -> float:
    """Seconds until the next poll of a transfer, after `previous_s`, `waited_s` into its wait.

    A transfer takes 0.1-10 ms once it starts, and a late poll adds straight to the request's TTFT: the
    delay doubles from 50 us up to 0.2 ms (a poll costs ~10 us of the event loop). But a receiver's wait
    starts before its prompt is computed, which under load takes seconds, and a poll every 0.2 ms all
    along keeps the event loop busy for every handoff in flight: past 20 ms of waiting, the cap becomes
    1% of the time waited so far, at most 2 ms (a poll is then late by at most 1% of the wait).
    """
    cap = min(max(2e-4, waited_s / 100), 2e-3)
    return min(max(2 * previous_s, 5e-5), cap)


class Waitable:
    """`wait` and `wait_sync` over a transfer endpoint's `poll` and `release` (KVTransferBackend, and
    kv_transfer.ranked.RankedTransfer, which drives one backend per tensor-parallel rank)."""

    def poll(self, handle: Any) -> TransferStatus:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        raise NotImplementedError

    async def wait(self, handle: Any, timeout_s: float) -> None:
        """Poll `handle` until DONE without blocking the event loop; ALWAYS releases it (also when
        the awaiting task is cancelled). Polls back off as `poll_delay` says.

        Raises KVTransferError if it FAILED, KVTransferTimeout if not done within `timeout_s`.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        delay = 0.0
        try:
            while True:
                status = self.poll(handle)
                if status is TransferStatus.DONE:
                    return
                if status is TransferStatus.FAILED:
                    raise KVTransferError(
                        f"transfer {handle.transfer_id!r} ({handle.role}, peer {handle.peer!r}) failed: {handle.error}"
                    )
                if time.monotonic() >= deadline:
                    raise KVTransferTimeout(
                        f"transfer {handle.transfer_id!r} ({handle.role}, peer "
                        f"{handle.peer!r}) not done after {timeout_s:.3g} s"
                    )
                await asyncio.sleep(delay)
                delay = poll_delay(delay, time.monotonic() - start)
        finally:
            self.release(handle)

    def wait_sync(self, handle: Any, timeout_s: float) -> None:
        """`wait` for callers without an event loop (benchmarks, tests)."""
        asyncio.run(self.wait(handle, timeout_s))


class KVTransferBackend(Waitable, abc.ABC):
    """Moves KV pages between two replicas' registered buffers.

    Contract: `__init__` registers `buffers` once (they must outlive the backend); `info()` is
    sent to peers, which pass it to `connect()`; both sides connect to each other before the
    first transfer. The sender calls `write`, the receiver `expect` with the same transfer_id
    and the same dst pages; each polls its own handle until DONE or FAILED and releases it.
    Transfer ids are unique per (peer, direction) among unreleased handles. No method waits for
    the peer (NCCL's first transfer of a pair excepted: it creates the communicator); a backend
    and its handles belong to one thread (the replica's event loop).
    """

    name: str = ""

    def __init__(self, agent_name: str, buffers: Sequence[torch.Tensor], page_size: int):
        if not agent_name:
            raise KVTransferError("agent_name must be a non-empty string")
        self.agent_name = agent_name
        self.buffers = list(buffers)
        self.layout = KVLayout.of(self.buffers, page_size)
        self._buffer_ids = np.arange(self.layout.num_buffers, dtype=np.int64)
        self._buffer_ids.flags.writeable = False  # shared by every handle
        self._peers: dict[str, PeerInfo] = {}
        self._live: dict[tuple[str, str], TransferHandle] = {}
        """(role, transfer_id) → unreleased handle."""
        self._closed = False

    # ---- the interface
    @abc.abstractmethod
    def info(self) -> PeerInfo:
        """What a peer needs to reach this backend."""

    def connect(self, peer: PeerInfo) -> None:
        """Make `peer` known (idempotent; reconnecting with a new instance replaces the old one)."""
        if peer.backend != self.name:
            raise KVTransferError(f"peer {peer.name!r} uses backend {peer.backend!r}, this side {self.name!r}")
        if peer.name == self.agent_name:
            raise KVTransferError(f"peer name {peer.name!r} is this agent's own name")
        self.layout.check_compatible(peer.layout, peer.name)
        known = self._peers.get(peer.name)
        if known is not None and known.instance == peer.instance:
            return
        if known is not None:
            self._disconnect(known)
        self._connect(peer)
        self._peers[peer.name] = peer

    def write(
        self, peer: str, src_pages: Any, dst_pages: Any, transfer_id: str, message: bytes = b"", src_ready: bool = False
    ) -> TransferHandle:
        """Start writing local src_pages into the peer's dst_pages, in every buffer (asynchronous; sender side).
        `message` (at most MAX_MESSAGE_BYTES) reaches the receiver's handle with the transfer's completion:
        when its expect is DONE, the pages and the message have both arrived.

        The bytes move once the work queued on the current CUDA stream so far is done (it may still be
        producing the src pages). `src_ready=True` is the caller's guarantee that the work producing them
        has completed already (it read on the host a result computed from them, as a prefill replica does
        with the first token), so the write starts without that wait."""
        info = self._peer(peer)
        if not isinstance(message, bytes) or len(message) > MAX_MESSAGE_BYTES:
            raise KVTransferError(
                f"message must be bytes of at most {MAX_MESSAGE_BYTES} (got "
                f"{type(message).__name__} of {len(message) if isinstance(message, bytes) else '?'})"
            )
        src = as_pages(src_pages, "src_pages")
        dst = as_pages(dst_pages, "dst_pages")
        if src.size != dst.size:
            raise KVTransferError(f"src_pages has {src.size} pages, dst_pages {dst.size}: lengths must match")
        runs = page_run_arrays(src, dst)
        n = src.size
        one_run = runs[2].size == 1  # consecutive ascending ids on both sides: no duplicates; bounds at the ends
        if not (
            one_run
            and 1 <= runs[0][0]
            and runs[0][0] + n <= self.layout.num_pages
            and 1 <= runs[1][0]
            and runs[1][0] + n <= info.layout.num_pages
        ):
            check_pages(src, self.layout.num_pages, "src_pages", unique=False)
            check_pages(dst, info.layout.num_pages, "dst_pages", unique=True)
        handle = self._new_handle("write", peer, transfer_id, n)
        handle.message = message
        self._start(handle, lambda: self._start_write(handle, info, src, dst, runs, src_ready))
        return handle

    def expect(self, peer: str, dst_pages: Any, transfer_id: str) -> TransferHandle:
        """Await the peer's write of transfer_id into local dst_pages (receiver side)."""
        self._peer(peer)
        dst = as_pages(dst_pages, "dst_pages")
        check_pages(dst, self.layout.num_pages, "dst_pages", unique=True)
        handle = self._new_handle("expect", peer, transfer_id, dst.size)
        self._start(handle, lambda: self._start_expect(handle, dst))
        return handle

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Non-blocking progress check; FAILED sets handle.error. Polling a released handle raises."""

    def release(self, handle: TransferHandle) -> None:
        """Free the handle's resources; an unfinished transfer is cancelled. Idempotent."""
        if handle.released:
            return
        handle.released = True
        self._live.pop((handle.role, handle.transfer_id), None)
        self._release(handle)

    def close(self) -> None:
        """Release every live handle, forget every peer, deregister the buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release_all()
        for peer in list(self._peers.values()):
            self._disconnect(peer)
        self._close()

    def _close(self) -> None:
        """Backend resources left after every handle and peer is gone (close() calls it once)."""

    # ---- helpers for subclasses
    def _peer(self, peer: str) -> PeerInfo:
        info = self._peers.get(peer)
        if info is None:
            raise KVTransferError(
                f"unknown peer {peer!r}: call connect() with its PeerInfo first (known: {sorted(self._peers)})"
            )
        return info

    def _new_handle(self, role: str, peer: str, transfer_id: str, num_pages: int) -> TransferHandle:
        if not isinstance(transfer_id, str) or not transfer_id:
            raise KVTransferError("transfer_id must be a non-empty string")
        if (role, transfer_id) in self._live:
            raise KVTransferError(f"transfer_id {transfer_id!r} is already in flight ({role})")
        bufs = self._buffer_ids
        handle = TransferHandle(
            transfer_id, peer, role, num_pages, num_pages * self.layout.page_bytes * bufs.size, buffer_ids=bufs
        )
        self._live[(role, transfer_id)] = handle
        return handle

    def _start(self, handle: TransferHandle, start: Any) -> None:
        try:
            start()
        except BaseException:
            self.release(handle)
            raise

    def _check_live(self, handle: TransferHandle) -> None:
        if handle.released:
            raise KVTransferError(f"handle of transfer {handle.transfer_id!r} was already released")

    def _release_all(self) -> None:
        for handle in list(self._live.values()):
            self.release(handle)

    @abc.abstractmethod
    def _connect(self, peer: PeerInfo) -> None: ...

    @abc.abstractmethod
    def _disconnect(self, peer: PeerInfo) -> None: ...

    @abc.abstractmethod
    def _start_write(
        self,
        handle: TransferHandle,
        peer: PeerInfo,
        src: np.ndarray,
        dst: np.ndarray,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        src_ready: bool,
    ) -> None:
        """Post the write; `runs` is page_run_arrays(src, dst), validated."""

    @abc.abstractmethod
    def _start_expect(self, handle: TransferHandle, dst: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _release(self, handle: TransferHandle) -> None: ...
