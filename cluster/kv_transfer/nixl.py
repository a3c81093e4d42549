"""NixlBackend: KV pages over NIXL's UCX backend (GPU memory as VRAM_SEG, host memory as DRAM_SEG).

Descriptors are built per transfer: one (address, bytes, device) region per buffer per run of
pages consecutive on both sides (`page_run_arrays`), local and remote, handed to `initialize_xfer`.
Why not lists prepared once with one descriptor per page (`prep_xfer_dlist` + indices): a page
is one token here, so that is 10^5-10^6 descriptors per peer (memory and start-up time), and
building them per transfer costs ~0.01 ms. Our Python around a write keeps to a few numpy calls.

Worker threads: the UCX backend runs as NIXL's thread-pool engine (`num_threads` dedicated UCX
workers, `split_batch_size` 1, so every WRITE is posted and progressed on a dedicated worker
thread, which sleeps while no transfer is in flight): on NIXL's default path (shared worker,
progress thread) a large GPU0→GPU1 WRITE stays well below the copy bandwidth whatever the
descriptors, READ or UCX knobs, and on a dedicated worker it reaches it (benchmarks/README.md,
KV transfer). The completion notice is sent when the sender's poll sees the data done. Known: a
WRITE to a peer that died leaves one UCX request object unreturned on this path (UCX warns at exit).

    sender (prefill)                                   receiver (decode)
    write(peer, src, dst, id) ── UCX WRITE ──────────▶ buffers[b][dst pages]
        poll: check_xfer_state                         expect(peer, dst, id)
              └── notification "kv|" <header size> "<id>|<crc>" <message> ──▶ poll: DONE once it arrives
                                                        (and its crc of dst pages and
                                                        buffer ids matches)

On GPU, write() records a CUDA event on the current stream and the WRITE is posted (by write
or a later poll) once it completed, so kernels still producing the src pages finish first;
with src_ready (a prefill replica: its first token is on the host) it is posted at once.

Transports: UCX picks them from `UCX_TLS`. For host memory the backend sets the default
`cma,tcp,self` when UCX_TLS is unset (shared-memory transports alone cannot reach a peer
without tcp); GPU memory keeps UCX's own choice (cuda_ipc/NVLink, rdma). Any UCX_* variable
set in the environment wins. NIXL's progress thread is on: without it, progress happens only
in poll, and a WRITE (host memory, UCX 1.5.1) completes only while the receiver polls as well.
`RADIXSERVE_NIXL_PROGRESS_THREAD=0` turns it off (faster on a 2-core host when both sides poll).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from cluster.kv_transfer.base import (
    KVTransferBackend,
    KVTransferError,
    PeerInfo,
    TransferHandle,
    TransferStatus,
    transfer_digest,
)

logger = logging.getLogger(__name__)

_NOTIF_PREFIX = b"kv|"
_STALE_NOTIF_S = 600.0
"""Notifications nobody expects (the expect was released first) are dropped after this long."""
DEFAULT_CPU_UCX_TLS = "cma,tcp,self"
DEFAULT_THREADS = 1
"""Dedicated UCX worker threads per agent (RADIXSERVE_NIXL_THREADS overrides; 0: NIXL's shared-worker path)."""


@dataclass
class _Write:
    """Sender-side state of one transfer."""

    local: Any
    """Rows (address, bytes, device id) of the src runs (_run_rows: a list of tuples or an (n, 3) array)."""
    remote: Any
    """Rows of the dst runs in the peer's buffers, in the same order."""
    notif: bytes
    ready: Any = None
    """CUDA event recorded at write(): posting waits for it (None for host memory)."""
    xfer: Any = None
    """The NIXL transfer handle, once posted."""


@dataclass
class _Expect:
    """Receiver-side state of one transfer."""

    digest: int
    """transfer_digest of the expected dst pages and buffers; the sender's notification must match."""
    done: bool = False


def import_nixl() -> Any:
    """The NIXL Python API module, whichever wheel is installed (meta package, else the wheel matching
    torch's CUDA major version, else the other one)."""
    cu = ["nixl_cu12._api", "nixl_cu13._api"]
    if not (torch.version.cuda or "").startswith("12"):
        cu.reverse()
    errors = []
    for name in ["nixl._api", *cu]:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise KVTransferError(
        "NIXL is not installed (pip install nixl-cu13, or nixl-cu12 for CUDA 12): " + "; ".join(errors)
    )


_LIST_ROWS_MAX = 32
"""Up to this many regions, descriptor rows are built as a list of tuples (cheaper than numpy's per-call cost
on the handoff's critical path); above it, as one numpy array."""


def _run_rows(bases: Sequence[int], starts: np.ndarray, lengths: np.ndarray, page_bytes: int, dev_id: int) -> Any:
    """(len(bases) × runs) rows (address, bytes, device id), buffer-major: runs of pages `starts[i]`..
    `starts[i] + lengths[i] - 1` in each buffer at base address `bases[b]`. A list of 3-tuples for few
    regions, else an (n, 3) int64 array (get_xfer_descs takes both)."""
    if starts.size == 1:  # the usual handoff: Python ints, no numpy calls
        offset, nbytes = int(starts[0]) * page_bytes, int(lengths[0]) * page_bytes
        return [(base + offset, nbytes, dev_id) for base in bases]
    if len(bases) * starts.size <= _LIST_ROWS_MAX:
        runs = list(zip((starts * page_bytes).tolist(), (lengths * page_bytes).tolist()))
        return [(base + offset, nbytes, dev_id) for base in bases for offset, nbytes in runs]
    rows = np.empty((len(bases), starts.size, 3), dtype=np.int64)
    rows[:, :, 0] = np.asarray(bases, dtype=np.int64)[:, None] + starts[None, :] * page_bytes
    rows[:, :, 1] = lengths * page_bytes
    rows[:, :, 2] = dev_id
    return rows.reshape(-1, 3)


@functools.lru_cache(maxsize=64)
def _device_index(device: str) -> int:
    return torch.device(device).index or 0


def _mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"


class NixlBackend(KVTransferBackend):
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        buffers: Sequence[torch.Tensor],
        page_size: int,
        num_threads: int | None = None,
        capture_telemetry: bool = False,
    ):
        """`num_threads`: dedicated UCX worker threads that post and progress every WRITE (None:
        RADIXSERVE_NIXL_THREADS, else DEFAULT_THREADS; 0: NIXL's shared worker and progress thread);
        `capture_telemetry` enables `regions()`."""
        super().__init__(agent_name, buffers, page_size)
        self._nixl = import_nixl()
        self._bases = [b.data_ptr() for b in self.buffers]
        self._events: list = []
        """CUDA events of posted writes, for reuse."""
        self._dev_id = _device_index(self.layout.device)
        self._init_env()
        self._init_agent(num_threads, capture_telemetry)
        self._instance = uuid.uuid4().hex
        self._info: PeerInfo | None = None
        self._arrived: dict[tuple[str, str], tuple[int, float, bytes]] = {}
        """(peer, transfer_id) → (digest, arrival time, message) of notifications not yet matched."""
        self._abandoned: dict[tuple[str, str], float] = {}
        """(peer, transfer_id) of expects released before their notification came."""
        self._pruned = time.monotonic()

    def _init_env(self) -> None:
        if self.layout.device == "cpu":
            os.environ.setdefault("UCX_TLS", DEFAULT_CPU_UCX_TLS)

    def _init_agent(self, num_threads: int | None, capture_telemetry: bool) -> None:
        # Without the progress thread a WRITE completes only while the receiver polls too.
        progress = os.environ.get("RADIXSERVE_NIXL_PROGRESS_THREAD", "1") != "0"
        if num_threads is None:
            num_threads = int(os.environ.get("RADIXSERVE_NIXL_THREADS", DEFAULT_THREADS))
        if num_threads < 0:
            raise KVTransferError(f"NIXL worker threads must be >= 0, got {num_threads}")
        config = self._nixl.nixl_agent_config(
            enable_prog_thread=progress, backends=[], capture_telemetry=capture_telemetry
        )
        self.agent = self._nixl.nixl_agent(self.agent_name, config)
        # split_batch_size 1: a transfer of any number of descriptors goes to the dedicated workers
        # (NIXL's default, 1024, keeps transfers of fewer descriptors on the slower shared worker).
        params = {"num_threads": str(num_threads), "split_batch_size": "1"} if num_threads else {}
        try:
            self.agent.create_backend("UCX", params)
        except Exception as e:  # the bindings raise their own exception types
            raise KVTransferError(
                "NIXL's UCX backend could not be created (is its plugin in this installation?): "
                f"{type(e).__name__}: {e}"
            ) from e
        self.num_threads = num_threads
        self._reg = self.agent.register_memory(self.buffers)

    def info(self) -> PeerInfo:
        # Built once: the registrations never change, and a decode replica sends it with every prefill call.
        if self._info is None:
            self._info = PeerInfo(
                name=self.agent_name,
                backend=self.name,
                layout=self.layout,
                instance=self._instance,
                buffer_addrs=tuple(b.data_ptr() for b in self.buffers),
                agent_metadata=self.agent.get_agent_metadata(),
            )
        return self._info

    # ---- peers
    def _connect(self, peer: PeerInfo) -> None:
        if len(peer.buffer_addrs) != peer.layout.num_buffers or not peer.agent_metadata:
            raise KVTransferError(f"PeerInfo of {peer.name!r} lacks NIXL metadata or buffer addresses")
        try:
            remote = self.agent.add_remote_agent(peer.agent_metadata)
        except Exception as e:
            raise KVTransferError(f"NIXL rejected the metadata of peer {peer.name!r}: {type(e).__name__}: {e}") from e
        remote = remote.decode() if isinstance(remote, bytes) else remote
        if remote != peer.name:
            self.agent.remove_remote_agent(remote)
            raise KVTransferError(f"NIXL metadata names agent {remote!r}, PeerInfo names {peer.name!r}")

    def _disconnect(self, peer: PeerInfo) -> None:
        for handle in [h for h in self._live.values() if h.peer == peer.name]:
            self.release(handle)
        try:
            self.agent.remove_remote_agent(peer.name)
        except Exception as e:  # a peer that died may already be gone from the agent
            logger.warning("disconnecting NIXL peer %r: %s", peer.name, e)
        self._peers.pop(peer.name, None)

    # ---- transfers
    def _start_write(
        self,
        handle: TransferHandle,
        peer: PeerInfo,
        src: np.ndarray,
        dst: np.ndarray,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        src_ready: bool,
    ) -> None:
        header = f"{handle.transfer_id}|{transfer_digest(dst, handle.buffer_ids)}".encode()
        notif = _NOTIF_PREFIX + struct.pack("<I", len(header)) + header + handle.message
        src_starts, dst_starts, lengths = runs
        page_bytes = self.layout.page_bytes
        write = _Write(
            _run_rows(self._bases, src_starts, lengths, page_bytes, self._dev_id),
            _run_rows(peer.buffer_addrs, dst_starts, lengths, page_bytes, _device_index(peer.layout.device)),
            notif,
        )
        if self.layout.device != "cpu" and not src_ready:  # post once the work queued so far is done
            write.ready = self._events.pop() if self._events else torch.cuda.Event()
            write.ready.record(torch.cuda.current_stream(self.buffers[0].device))
        handle.state = write
        self._post(handle)

    def _post(self, handle: TransferHandle) -> None:
        write: _Write = handle.state
        if write.ready is not None:
            if not write.ready.query():
                return
            self._events.append(write.ready)  # reused: no event created or destroyed per transfer
            write.ready = None
        try:  # runtime failures (peer gone) surface through poll/wait, like those after posting
            mem = _mem_type(self.layout.device)
            write.xfer = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(write.local, mem),
                self.agent.get_xfer_descs(write.remote, mem),
                handle.peer,
                write.notif,
            )
            if self.agent.transfer(write.xfer) == "ERR":
                handle.error = "NIXL could not post the WRITE"
        except Exception as e:  # the bindings raise their own exception types (nixl*Error)
            handle.error = f"NIXL could not post the WRITE: {type(e).__name__}: {e}"

    def _start_expect(self, handle: TransferHandle, dst: np.ndarray) -> None:
        handle.state = _Expect(transfer_digest(dst, handle.buffer_ids))
        self._abandoned.pop((handle.peer, handle.transfer_id), None)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self._check_live(handle)
        if handle.error is not None:
            return TransferStatus.FAILED
        if handle.role == "write":
            if handle.state.xfer is None:
                self._post(handle)
                if handle.state.xfer is None or handle.error is not None:
                    return TransferStatus.FAILED if handle.error is not None else TransferStatus.PENDING
            try:
                state = self.agent.check_xfer_state(handle.state.xfer)
            except Exception as e:
                state, handle.error = "ERR", f"{type(e).__name__}: {e}"
            if state == "DONE":
                return TransferStatus.DONE
            if state == "ERR":
                handle.error = handle.error or "NIXL reported a transfer error (peer gone or unreachable?)"
                return TransferStatus.FAILED
            return TransferStatus.PENDING
        if handle.state.done:
            return TransferStatus.DONE
        try:
            self._drain_notifs()
        except Exception as e:  # the bindings raise their own exception types
            handle.error = f"reading NIXL notifications failed: {type(e).__name__}: {e}"
            return TransferStatus.FAILED
        arrived = self._arrived.pop((handle.peer, handle.transfer_id), None)
        if arrived is None:
            return TransferStatus.PENDING
        digest, _, message = arrived
        if digest != handle.state.digest:
            handle.error = "the sender's dst pages or buffers differ from the expected ones (digest mismatch)"
            return TransferStatus.FAILED
        handle.state.done, handle.message = True, message
        return TransferStatus.DONE

    def regions(self, handle: TransferHandle) -> int:
        """Memory regions NIXL moved for a DONE, unreleased write: num_buffers × page runs.
        Needs capture_telemetry=True."""
        self._check_live(handle)
        if handle.role != "write" or handle.state.xfer is None:
            raise KVTransferError("regions() needs a posted write handle")
        return int(self.agent.get_xfer_telemetry(handle.state.xfer).descCount)

    def _drain_notifs(self) -> None:
        now = time.monotonic()
        for peer, messages in self.agent.get_new_notifs().items():
            for msg in messages:
                if not msg.startswith(_NOTIF_PREFIX):
                    continue
                at = len(_NOTIF_PREFIX) + 4
                (size,) = struct.unpack("<I", msg[at - 4 : at])
                transfer_id, _, digest = msg[at : at + size].decode().rpartition("|")
                key = (peer, transfer_id)
                if self._abandoned.pop(key, None) is None:
                    self._arrived[key] = (int(digest), now, msg[at + size :])
        if now - self._pruned > _STALE_NOTIF_S / 10:
            self._pruned = now
            self._arrived = {k: v for k, v in self._arrived.items() if now - v[1] < _STALE_NOTIF_S}
            self._abandoned = {k: t for k, t in self._abandoned.items() if now - t < _STALE_NOTIF_S}

    def _release(self, handle: TransferHandle) -> None:
        if handle.role == "expect":
            key = (handle.peer, handle.transfer_id)
            unfinished = isinstance(handle.state, _Expect) and not handle.state.done and handle.error is None
            if self._arrived.pop(key, None) is None and unfinished:
                self._abandoned[key] = time.monotonic()  # its notification, if it comes, is dropped
            return
        if isinstance(handle.state, _Write) and handle.state.ready is not None:
            self._events.append(handle.state.ready)  # re-recording a pending event is allowed
            handle.state.ready = None
        if handle.state is not None and handle.state.xfer is not None:
            try:
                handle.state.xfer.release()
            except Exception as e:  # NIXL could not cancel an active transfer; it retries at agent teardown
                logger.warning("releasing NIXL transfer %r: %s", handle.transfer_id, e)

    def _close(self) -> None:
        self.agent.deregister_memory(self._reg)
