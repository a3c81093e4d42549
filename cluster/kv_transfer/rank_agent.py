"""A follower rank's KV transfer endpoint (tensor parallelism): a backend of its own over its own KV pool shard,
driven by rank 0 (kv_transfer.ranked.RankedTransfer) through the engine's step channel.

    rank 0: RankedTransfer                  rank r: step loop             rank r: agent thread (owns the backend)
    Engine.call_other_ranks(                command(runner, op, *args)
        __name__, "command", op, *args) ──▶   queue.put ───────────────▶ applies the ops in order, polls its
                                                                        live handles between them
    TCPStore of the group (store_port)  ◀────────────────────────────── info_key(r): its PeerInfo (pickled), or
                                                                          the KVTransferError that stopped it
                                                                        status_key(role, id, r): b"ok" or
                                                                          b"error: ..." once the handle ended

Ops: "start" (backend, agent name, page size), "connect" (the peer's PeerInfo of every rank: this rank connects
to its own), "write" / "expect" (peer names of every rank, pages, transfer id), "release" (role, transfer id:
the handle is released if still live and its status key deleted), "stop" (close the backend; the thread ends).
The page ids mean the same on every rank (every rank's pool has the same slots, its own heads), so every rank
moves the pages rank 0 chose. A command runs in the step loop: it only queues (never waits on a transfer).
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple

import torch

from cluster.kv_transfer import KVTransferError, TransferStatus, kv_pool_buffers, make_backend

logger = logging.getLogger(__name__)

_MAX_POLL_DELAY_S = 1e-3
_STORE_TIMEOUT = timedelta(seconds=60)


def info_key(rank: int) -> str:
    return f"kvx/info/{rank}"


def status_key(role: str, transfer_id: str, rank: int) -> str:
    return f"kvx/{role}/{transfer_id}/{rank}"


def agent_name(base: str, rank: int) -> str:
    """The NIXL agent (or NCCL endpoint) name of `rank` of the replica whose rank 0 is named `base`."""
    return base if rank == 0 else f"{base}/rank{rank}"


_AGENT: Optional["RankAgent"] = None
"""This process's agent (a follower process holds one engine)."""


def command(runner: Any, op: str, *args: Any) -> None:
    """Rank 0's op for this rank's agent (the step loop calls it; see the module docstring)."""
    global _AGENT
    if op == "start":
        if _AGENT is not None:
            _AGENT.put("stop", ())
        _AGENT = RankAgent(runner, *args)
    elif _AGENT is None:
        logger.warning("KV transfer op %r before the agent was started: ignored", op)
    else:
        _AGENT.put(op, args)
        if op == "stop":
            _AGENT = None


class RankAgent:
    """The thread that owns rank r's backend: applies rank 0's ops in order and reports each transfer's end."""

    def __init__(self, runner: Any, backend: str, base_name: str, page_size: int):
        self.rank = runner.tp.rank
        self._runner = runner
        self._args = (backend, agent_name(base_name, self.rank), page_size)
        self._ops: "queue.SimpleQueue[Tuple[str, tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kv-rank{self.rank}", daemon=True)
        self._thread.start()

    def put(self, op: str, args: tuple) -> None:
        self._ops.put((op, args))

    def _run(self) -> None:
        import torch.distributed as dist  # noqa: PLC0415  (tensor parallelism only)

        store = dist.TCPStore("127.0.0.1", self._runner.tp.store_port, is_master=False, timeout=_STORE_TIMEOUT)
        if self._runner.device.type == "cuda":
            torch.cuda.set_device(self._runner.device)
        name, page_size = self._args[1], self._args[2]
        try:
            backend = make_backend(self._args[0], name, kv_pool_buffers(self._runner.kv_pool), page_size)
        except Exception as exc:  # noqa: BLE001 - rank 0 raises it
            logger.exception("rank %d: the KV transfer backend did not start", self.rank)
            store.set(info_key(self.rank), pickle.dumps(KVTransferError(f"rank {self.rank}: {exc}")))
            return
        store.set(info_key(self.rank), pickle.dumps(backend.info()))
        live: Dict[Tuple[str, str], Any] = {}
        delay = 0.0
        while True:
            try:
                if not live:
                    op, args = self._ops.get()
                else:
                    op, args = self._ops.get(timeout=delay) if delay else self._ops.get_nowait()
            except queue.Empty:
                op, args = "", ()
            if op == "stop":
                backend.close()
                return
            if op:
                self._apply(backend, store, live, op, args)
                delay = 0.0
            for key, handle in list(live.items()):
                status = backend.poll(handle)
                if status is TransferStatus.PENDING:
                    continue
                ended = b"ok" if status is TransferStatus.DONE else f"error: {handle.error}".encode()
                store.set(status_key(*key, self.rank), ended)
                backend.release(handle)
                del live[key]
            delay = min(max(2 * delay, 5e-5), _MAX_POLL_DELAY_S)

    def _apply(self, backend: Any, store: Any, live: Dict[Tuple[str, str], Any], op: str, args: tuple) -> None:
        if op == "connect":
            (peers,) = args
            try:
                backend.connect(peers[self.rank])
            except Exception:  # noqa: BLE001 - its transfers fail (unknown peer) and say so
                logger.exception("rank %d: connecting KV peer %r failed", self.rank, peers[self.rank].name)
            return
        if op == "release":
            role, transfer_id = args
            handle = live.pop((role, transfer_id), None)
            if handle is not None:
                backend.release(handle)
            store.delete_key(status_key(role, transfer_id, self.rank))
            return
        role, transfer_id = op, args[-1] if op == "expect" else args[3]
        try:
            if op == "write":
                peers, src, dst, transfer_id, src_ready = args
                handle = backend.write(peers[self.rank], src, dst, transfer_id, src_ready=src_ready)
            elif op == "expect":
                peers, dst, transfer_id = args
                handle = backend.expect(peers[self.rank], dst, transfer_id)
            else:
                raise KVTransferError(f"unknown KV transfer op {op!r}")
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 as this rank's failure of the transfer
            store.set(status_key(role, transfer_id, self.rank), f"error: {type(exc).__name__}: {exc}".encode())
            return
        live[(role, transfer_id)] = handle
