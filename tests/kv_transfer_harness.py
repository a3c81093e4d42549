"""KV transfer test helpers: a KV transfer backend over a small KVPool in a child process (spawn).

`PeerProcess(...)` starts the child; `peer.call(method, *args)` runs a `_Peer` method there and
returns its result, re-raising its exception (with the child's type) here.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import torch

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 2, 2, 8, 4


def make_pool(num_pages: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A KVPool of `num_pages` pages of PAGE_SIZE slots (zeros)."""
    from engine.memory.kv_pool import KVPool

    return KVPool(num_pages * PAGE_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device(device))


def fill(buffers: list[torch.Tensor], seed: int) -> None:
    """Distinct random values in every buffer (a fixed seed, so the peer can recompute them)."""
    gen = torch.Generator().manual_seed(seed)
    for buf in buffers:
        buf.copy_(torch.rand(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype))


class _Peer:
    """Lives in the child process: one backend over one KVPool."""

    def __init__(self, backend: str, name: str, num_pages: int, device: str):
        from cluster.kv_transfer import kv_pool_buffers, make_backend

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        self.pool = make_pool(num_pages, device=device)
        self.buffers = kv_pool_buffers(self.pool)
        self.backend = make_backend(backend, name, self.buffers, PAGE_SIZE)

    def info(self):
        return self.backend.info()

    def export(self):
        """The pool's KVPoolHandle (CUDA pools: CUDA IPC), for another process to map."""
        return self.pool.export()

    def connect(self, info) -> None:
        self.backend.connect(info)

    def fill(self, seed: int) -> None:
        fill(self.buffers, seed)

    def buffers_cpu(self) -> list[torch.Tensor]:
        # Copies: pickling a CPU tensor through multiprocessing moves its storage to shared
        # memory, which would move the registered buffers away from their registered addresses.
        return [b.to("cpu", copy=True) for b in self.buffers]

    def write(self, peer: str, src, dst, transfer_id: str, timeout_s: float) -> None:
        handle = self.backend.write(peer, src, dst, transfer_id)
        asyncio.run(self.backend.wait(handle, timeout_s))

    def expect(self, peer: str, dst, transfer_id: str, timeout_s: float) -> bytes:
        """Await one transfer; returns the message that came with it."""
        handle = self.backend.expect(peer, dst, transfer_id)
        asyncio.run(self.backend.wait(handle, timeout_s))
        return handle.message

    def expect_many(self, peer: str, transfers: list[tuple], timeout_s: float) -> list[bytes]:
        """Expect every (dst_pages, transfer_id) at once, in the given order, and wait for all; returns
        their messages in that order."""
        handles = [self.backend.expect(peer, *transfer) for transfer in transfers]

        async def wait_all():
            await asyncio.gather(*(self.backend.wait(h, timeout_s) for h in handles))

        asyncio.run(wait_all())
        return [h.message for h in handles]

    def live_handles(self) -> int:
        return len(self.backend._live)


def _serve(conn, args) -> None:
    try:
        peer = _Peer(*args)
    except Exception as e:  # re-raised in the test process
        conn.send(("err", e))
        return
    conn.send(("ok", None))
    while True:
        msg = conn.recv()
        if msg is None:
            peer.backend.close()
            return
        method, call_args = msg
        try:
            conn.send(("ok", getattr(peer, method)(*call_args)))
        except Exception as e:  # sent back to the test process, which re-raises it
            conn.send(("err", e))


class PeerProcess:
    """A `_Peer` in a spawned process. Calls are synchronous; `start_call`/`finish_call` split one."""

    def __init__(self, backend: str, name: str, num_pages: int, device: str = "cpu", timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, (backend, name, num_pages, device)), daemon=True)
        self.proc.start()
        self.timeout_s = timeout_s
        self._result()

    def _result(self) -> Any:
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError("peer process did not answer")
        status, value = self._conn.recv()
        if status == "err":
            raise value
        return value

    def start_call(self, method: str, *args: Any) -> None:
        self._conn.send((method, args))

    def finish_call(self) -> Any:
        return self._result()

    def call(self, method: str, *args: Any) -> Any:
        self.start_call(method, *args)
        return self.finish_call()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self._conn.send(None)
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
