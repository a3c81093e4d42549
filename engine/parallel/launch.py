"""Starting a tensor-parallel group: rank 0 spawns ranks 1..N-1 and watches them.

    rank 0 (the engine core)                              rank r (`python -m <follower module>`)
    TCPStore on 127.0.0.1, a free port  ──FollowerSpec on stdin──▶  joins the store, sets ready/<r>
    waits for every ready/<r> while watching the processes          TPGroup(r, ...)
    TPGroup(0, ...)  ◀────── init_process_group: every rank ──────▶ builds its model shard, then follows
                                                                    rank 0's steps until told to stop

Rank 0 never waits for a rank that is already dead: the ready keys are polled beside the processes, and
after start-up a thread per rank process waits for its exit; an exit that nobody asked for becomes
`RankProcesses.failure`, a TensorParallelError naming the rank, which the next step (or the one waiting on
that rank's collective) raises. Follower ranks exit with rank 0's process (`exit_with_parent`) and when a
collective with rank 0 fails.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from engine.errors import TensorParallelError
from engine.parallel.group import TPGroup, rank_device

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0
"""Bound on the other ranks' start (interpreter, imports) before they join the group."""
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.05


@dataclass(frozen=True)
class FollowerSpec:
    """What rank `rank` is started with (pickled on its stdin)."""

    config: Any
    """The engine's EngineConfig: every rank builds its shard of the same model."""
    rank: int
    size: int
    store_port: int
    parent_pid: int
    log_level: int


class RankProcesses:
    """Rank 0's handle on the processes of ranks 1..size-1: spawned here, one watcher thread each."""

    def __init__(self, module: str, config: Any, size: int, store_port: int):
        self.failure: Optional[TensorParallelError] = None
        """The first unexpected exit of a rank (None while every rank lives or once stopping)."""
        self.on_failure: Optional[Callable[[], None]] = None
        """Called (on a watcher thread) when `failure` is set: TPGroup aborts work that would wait forever."""
        self._stopping = False
        self._procs: List[subprocess.Popen] = []
        env = dict(os.environ)
        # The ranks import this package from wherever rank 0 did (a Ray worker's working dir too).
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        level = logging.getLogger().getEffectiveLevel()
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env)
                self._procs.append(proc)
                spec = FollowerSpec(config, rank, size, store_port, os.getpid(), level)
                proc.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
                proc.stdin.close()
        except BaseException:
            self.kill()
            raise
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}-watch", daemon=True).start()

    @property
    def pids(self) -> List[int]:
        """Process ids of ranks 1..size-1, in rank order."""
        return [p.pid for p in self._procs]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping or self.failure is not None:
            return
        self.failure = TensorParallelError(
            f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}: the engine stops (the rank's "
            "log is above)"
        )
        logger.error("%s", self.failure)
        if self.on_failure is not None:
            self.on_failure()

    def _exited(self) -> Optional[TensorParallelError]:
        """The failure of a rank whose exit the watcher has not recorded yet (polled here)."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None and not self._stopping:
                return self.failure or TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}: the engine stops"
                )
        return self.failure

    def wait_for_failure(self, timeout_s: float) -> Optional[TensorParallelError]:
        """The failure of a rank that exits within `timeout_s` (None if all still live then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            failure = self._exited()
            if failure is not None or time.monotonic() >= deadline:
                return failure
            time.sleep(_POLL_S)

    def wait_ready(self, store: dist.Store, timeout_s: float) -> None:
        """Wait until every rank has reached the store; raise TensorParallelError if one exits first."""
        keys = [f"ready/{rank}" for rank in range(1, len(self._procs) + 1)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            failure = self._exited()
            if failure is not None:
                raise failure
            if time.monotonic() >= deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait for the ranks, told to stop, to exit; kill those that do not within `timeout_s`."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank process %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """End every rank process now (after a failure, or when start-up fails)."""
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def start_group(config: Any, base_device: torch.device, follower_module: str) -> TPGroup:
    """Rank 0: spawn `python -m follower_module` for ranks 1..N-1 and join them (N = tensor_parallel_size).

    Returns rank 0's TPGroup (its `processes` watch the others); raises TensorParallelError when a rank exits
    before joining. On failure every spawned process is ended."""
    size = config.tensor_parallel_size
    device = rank_device(base_device, 0)
    for rank in range(1, size):
        rank_device(base_device, rank)  # every rank's device exists, before anything is spawned
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=START_TIMEOUT_S)
    )
    processes = RankProcesses(follower_module, config, size, store.port)
    try:
        processes.wait_ready(store, START_TIMEOUT_S)
        return TPGroup(0, size, device, store, processes)
    except BaseException:
        processes.kill()
        raise


def join_group(spec: FollowerSpec, base_device: torch.device) -> TPGroup:
    """Rank spec.rank (a follower process): join rank 0's group. Returns once every rank has joined."""
    store = dist.TCPStore(
        "127.0.0.1", spec.store_port, spec.size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S)
    )
    store.set(f"ready/{spec.rank}", "1")
    return TPGroup(spec.rank, spec.size, rank_device(base_device, spec.rank), store)


def exit_with_parent(parent_pid: int) -> None:
    """Run on a daemon thread of a follower: end the process once rank 0's process is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)
