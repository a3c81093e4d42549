"""DeviceClock: how long the device spent running the steps a ModelRunner launched.

    start() ─▶ CUDA event (timing) queued on the current stream, before the step's first kernel
    stop(e) ─▶ a second event queued after the step's last work (its result copies); the pair waits
    busy_s() ─▶ Σ elapsed(start, stop) over the pairs the device has finished, in seconds

The events run in stream order, so a start event completes when the device reaches the step, not when the
host queued it: elapsed(start, stop) is the step's time on the device, and the wall time between one
step's stop and the next one's start, which the sum leaves out, is time the device sat idle waiting for the
host. The share busy_s / wall time of a busy engine therefore says whether the host keeps the device fed.
Input copies queued before `start` (ScheduleBatch.prepare) count as idle: microseconds per step.

Pairs are collected at every stop(), so at most the steps in flight wait (overlap scheduling: two). On the
CPU nothing is recorded and busy_s() stays 0. Owned by the scheduler's thread; not thread-safe.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Optional, Tuple

import torch


class DeviceClock:
    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self._pending: Deque[Tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._busy_s = 0.0

    def start(self) -> Optional[torch.cuda.Event]:
        """Queue the event that opens a step (None on the CPU)."""
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: Optional[torch.cuda.Event]) -> None:
        """Queue the event that closes the step `started` opened; collect the steps the device has finished."""
        if started is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append((started, event))
        self._collect()

    def busy_s(self) -> float:
        """Device seconds of the finished steps since this clock was made."""
        self._collect()
        return self._busy_s

    def reset(self) -> None:
        """Start the sum from zero (steps still in flight are dropped)."""
        self._pending.clear()
        self._busy_s = 0.0

    def _collect(self) -> None:
        # Stream order: once one pair is unfinished, so are the ones queued after it.
        while self._pending and self._pending[0][1].query():
            started, stopped = self._pending.popleft()
            self._busy_s += started.elapsed_time(stopped) / 1e3
