"""TPGroup: one rank's membership of a tensor-parallel group, over torch.distributed.

Two process groups join the same ranks:

    compute   the forward's collectives on device tensors (all-reduce, the logits' all-gather, the step's
              input ids): NCCL on CUDA, gloo on the CPU; a collective that waits longer than
              COLLECTIVE_TIMEOUT_S fails (a rank that hangs)
    control   rank 0's step plans, host tensors (engine.parallel.step), and start-up agreements: gloo; its
              timeout is IDLE_TIMEOUT, because a follower waits on it for as long as the engine is idle

On CUDA, `enable_peer_all_reduce` adds a PeerAllReduce (engine.parallel.allreduce): the forward's small
all-reduces then run over NVLink peer memory, larger ones over NCCL. Both kinds can be captured in CUDA
graphs.

A rank that dies closes its gloo connections, so the collective waiting on it fails at once; on rank 0,
`guard()` turns that failure into a TensorParallelError naming the dead rank (engine.parallel.launch
watches the processes). torch.distributed keeps one default group per process, so a process holds at most
one tensor-parallel engine (servers run each engine's rank 0 in a core process of its own).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist

from engine.errors import InvalidConfigError, TensorParallelError

if TYPE_CHECKING:  # pragma: no cover
    from engine.parallel.allreduce import PeerAllReduce
    from engine.parallel.launch import RankProcesses

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0
"""Bound on one collective of a forward (first steps on CUDA may compile kernels on one rank meanwhile)."""
IDLE_TIMEOUT = timedelta(days=30)
"""Timeout of the control group: followers wait on it between steps, for as long as the engine is idle."""
DEATH_GRACE_S = 5.0
"""After a failed collective, how long rank 0 waits to see which rank process exited."""


def rank_device(base: torch.device, rank: int) -> torch.device:
    """The device of `rank`: the CPU for a CPU engine; cuda:(base index + rank) for a CUDA one."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise InvalidConfigError(
            f"tensor-parallel rank {rank} needs cuda:{index}, but {torch.cuda.device_count()} CUDA device(s) are "
            f"visible"
        )
    return torch.device("cuda", index)


class TPGroup:
    """This process's rank of a tensor-parallel group (engine.parallel.shard.TensorParallel for the model).

    Built by every rank with the same `size` and a store they share (rank 0's); the constructor returns once
    every rank has joined. Rank 0 passes `processes`, its handle on the other ranks."""

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.Store,
        processes: Optional["RankProcesses"] = None,
    ):
        if dist.is_initialized():
            raise InvalidConfigError(
                "this process already belongs to a torch.distributed group: it can hold one tensor-parallel "
                "engine (run more with core_process=True)"
            )
        self.rank, self.size, self.device = rank, size, device
        self.processes = processes
        self._store = store  # rank 0's store serves the group for its lifetime
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.peer: Optional["PeerAllReduce"] = None
        """Peer-memory all-reduce for small tensors (enable_peer_all_reduce); None: NCCL or gloo for all."""
        self._closed = False
        if processes is not None:
            processes.on_failure = self._abort_compute

    @property
    def store_port(self) -> int:
        """Port of rank 0's TCPStore on 127.0.0.1: other services of the group's ranks may meet there too."""
        return self._store.port

    def enable_peer_all_reduce(self, dtype: torch.dtype) -> bool:
        """CUDA: route small all-reduces of `dtype` through peer memory from now on (a collective: every rank
        calls it at the same point). False, with a warning, where the GPUs cannot map each other's memory
        (NCCL then takes every all-reduce)."""
        from engine.parallel.allreduce import PeerAllReduce, PeerMemoryUnavailable  # noqa: PLC0415  (CUDA only)

        if self.backend != "nccl":
            return False
        try:
            self.peer = PeerAllReduce(self.compute, self.device, dtype)
        except PeerMemoryUnavailable as exc:
            logger.warning("%s: all-reduces use NCCL", exc)
            return False
        return True

    # ---- collectives of a forward (TensorParallel) ----------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.peer is not None and self.peer.can_run(x):
            return self.peer(x)
        dist.all_reduce(x, group=self.compute)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        rows = x.reshape(-1, n).contiguous()
        parts = torch.empty((self.size * rows.shape[0], n), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(parts, rows, group=self.compute)  # rank r's rows at [r * R, (r + 1) * R)
        gathered = parts.view(self.size, rows.shape[0], n).permute(1, 0, 2)
        return gathered.reshape(*x.shape[:-1], self.size * n)

    # ---- rank 0 → every rank ---------------------------------------------------------------------
    def broadcast_compute(self, x: torch.Tensor) -> None:
        """Rank 0's `x` (a device tensor) into every rank's `x` (same shape and dtype)."""
        dist.broadcast(x, src=0, group=self.compute)

    def broadcast_control(self, x: torch.Tensor) -> None:
        """Rank 0's `x` (a host tensor) into every rank's `x` (same shape and dtype)."""
        dist.broadcast(x, src=0, group=self.control)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (start-up agreements such as the KV pool's size)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # ---- failures --------------------------------------------------------------------------------
    @property
    def failure(self) -> Optional[TensorParallelError]:
        """Rank 0: the death of another rank, once seen (None elsewhere or while all live)."""
        return self.processes.failure if self.processes is not None else None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Rank 0, around one step: raises TensorParallelError when a rank is known dead, and turns the failure
        of a collective into one naming the rank that died (other errors pass through)."""
        if self.failure is not None:
            raise self.failure
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as exc:
            dead = self.processes.wait_for_failure(DEATH_GRACE_S) if self.processes is not None else None
            if dead is not None:
                raise dead from exc
            if isinstance(exc, dist.DistError):
                raise TensorParallelError(f"a tensor-parallel collective failed: {exc}") from exc
            raise

    def _abort_compute(self) -> None:
        """Another rank died: NCCL work waiting on it would never end, so abort the compute group (gloo fails
        such work by itself)."""
        if self.backend == "nccl" and hasattr(self.compute, "abort"):
            try:
                self.compute.abort()
            except Exception:  # noqa: BLE001 - best effort; the step that waits still times out
                logger.exception("could not abort the NCCL group")

    def close(self) -> None:
        """Leave the group (idempotent). Rank 0 stops the other ranks first (ModelRunner.close)."""
        if self._closed:
            return
        self._closed = True
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group broken by a dead rank may refuse; the process leaves it anyway
            logger.warning("tensor-parallel group of rank %d did not close cleanly", self.rank, exc_info=True)
