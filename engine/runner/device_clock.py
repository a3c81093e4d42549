"""DeviceClock: how long the device spent running the steps a ModelRunner launched, and how long it sat
idle between them, by the kind of step it was waiting for.

    start()          ─▶ CUDA event (timing) queued on the current stream, before the step's first kernel
    stop(e, kind)    ─▶ a second event after the step's last work (its result copies); the pair waits
    break_chain()    ─▶ the scheduler found nothing to launch: the next step's wait is not a gap
    busy_s()         ─▶ Σ elapsed(start, stop) over the pairs the device has finished, in seconds
    gap_s(kind)      ─▶ Σ elapsed(previous stop, start) before the finished steps of that kind

Events run in stream order, so a start event completes when the device reaches it (after the step before
it, or when the host queues it, whichever is later), and a stop event when the step's work is done:

  - a gap (previous stop → start) is time the device had nothing queued: it waited for the host to plan
    and prepare the next step. Gaps are counted only between steps the scheduler launched back to back
    (no break_chain() between them), so an engine without work adds none. Input copies that
    ScheduleBatch.prepare queues before `start` fall into the gap (microseconds per step).
  - busy (start → stop) also contains the waits inside a step: a step whose kernels the host queues more
    slowly than the device runs them (an eager prefill bound by the host) keeps the device idle inside it.
    So busy_s is an upper bound of the device's work, and the gaps a lower bound of its idle time.

Kinds: "decode", "mixed" (a prefill step that also decodes running requests), "prefill". Pairs are
collected at every stop(), so at most the steps in flight wait (overlap scheduling: two). On the CPU
nothing is recorded and every sum stays 0. Owned by the scheduler's thread; not thread-safe.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, NamedTuple, Optional

import torch

KINDS = ("decode", "mixed", "prefill")


class _Step(NamedTuple):
    start: torch.cuda.Event
    stop: torch.cuda.Event
    kind: str
    chained: bool
    """Launched right after the step before it (no break_chain() between): its wait counts as a gap."""


class DeviceClock:
    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self._pending: Deque[_Step] = deque()
        self._chained = False
        self._last_stop: Optional[torch.cuda.Event] = None
        self.reset()

    def start(self) -> Optional[torch.cuda.Event]:
        """Queue the event that opens a step (None on the CPU)."""
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: Optional[torch.cuda.Event], kind: str) -> None:
        """Queue the event that closes the step `started` opened; collect the steps the device has finished."""
        if started is None:
            return
        if kind not in KINDS:
            raise ValueError(f"step kind must be one of {KINDS}, got {kind!r}")
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append(_Step(started, event, kind, self._chained))
        self._chained = True
        self._collect()

    def break_chain(self) -> None:
        """The scheduler launched nothing this time: the device's wait for the next step is no gap."""
        self._chained = False

    def busy_s(self) -> float:
        """Device seconds of the finished steps."""
        self._collect()
        return self._busy_s

    def gap_s(self) -> Dict[str, float]:
        """Seconds the device waited before finished steps launched back to back, by the step's kind."""
        self._collect()
        return dict(self._gap_s)

    def reset(self) -> None:
        """Start every sum from zero (steps still in flight are dropped)."""
        self._pending.clear()
        self._chained = False
        self._last_stop = None
        self._busy_s = 0.0
        self._gap_s = dict.fromkeys(KINDS, 0.0)

    def _collect(self) -> None:
        # Stream order: once one step is unfinished, so are the ones queued after it.
        while self._pending and self._pending[0].stop.query():
            step = self._pending.popleft()
            self._busy_s += step.start.elapsed_time(step.stop) / 1e3
            if step.chained and self._last_stop is not None:
                self._gap_s[step.kind] += max(0.0, self._last_stop.elapsed_time(step.start) / 1e3)
            self._last_stop = step.stop
