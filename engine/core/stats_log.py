"""StatsLog: one log line per interval of a busy engine, as vLLM's and SGLang's servers print.

    last 10.0 s: prompt 24510 tok/s (cache hit 69.8%), generation 4390 tok/s; running 32, waiting 0;
    KV 3.1% used; steps 1712 (prefill 73, 61 of them mixed; decode 1639); longest step 58.3 ms;
    waiting on the device 71%; device busy 97%, idle between steps 2.1% (before decode 0.4%, mixed 1.6%,
    prefill 0.1%)

Rates are over the interval, from EngineStats' counters (the cache hit rate too: cached / prompt tokens of
the interval). An interval starts with the first iteration that does work after the previous line or
after idle time, so idle time never dilutes the rates. "longest step" is the longest loop iteration that
did work (messages handled, one scheduler step launched, the previous one's results processed): a stall
of the loop, whatever its cause, shows there. "waiting on the device" is the share of the interval the
loop spent blocked on a step's results (EngineStats.device_wait_s): near 0 on a GPU, the host is what
bounds the steps; high, the device is. "device busy" (GPU only) is the share of the interval the device
spent running steps, and "idle between steps" the share it had nothing queued while the host planned and
prepared the next step, split by the kind of step it waited for (CUDA events around each step:
engine/runner/device_clock.py, which says what each one counts). An idle engine prints nothing.

Owned by EngineCore (its loop thread); not thread-safe.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from engine.outputs import EngineStats
from engine.runner.device_clock import KINDS

logger = logging.getLogger(__name__)

_RATES = (
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "prefill_steps",
    "mixed_steps",
    "decode_steps",
    "device_wait_s",
    "device_busy_s",
    *(f"device_gap_{kind}_s" for kind in KINDS),
)


class StatsLog:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        """`interval_s` > 0: the shortest time between two lines."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        if logger.level == logging.NOTSET and not logger.isEnabledFor(logging.INFO):
            # A positive interval asks for the lines: a process whose root logger stays at WARNING (a Ray
            # replica's, whose level the engine core process inherits) would drop every one of them. A level
            # set on this logger itself is the caller's choice and stays.
            logger.setLevel(logging.INFO)
        self._clock = clock
        self._since = clock()
        self._last: Optional[EngineStats] = None
        self._longest_s = 0.0
        self._busy = False

    def iteration(self, seconds: float) -> None:
        """A loop iteration that did work took `seconds`. The first one after a line or after idle time starts
        the interval: iterations without work move none of the counters a line reads, so the last line's stats
        stay its baseline."""
        if not self._busy:
            self._since = self._clock() - seconds
        self._busy = True
        self._longest_s = max(self._longest_s, seconds)

    def due(self) -> bool:
        """Whether a line is due (the interval has passed and the engine did work in it)."""
        return self._busy and self._clock() - self._since >= self.interval_s

    def line(self, stats: EngineStats) -> str:
        """The interval's line from `stats` (taken now); starts the next interval."""
        now = self._clock()
        elapsed = max(now - self._since, 1e-9)
        last = self._last
        delta = {k: getattr(stats, k) - (getattr(last, k) if last is not None else 0) for k in _RATES}
        hit = delta["cached_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else 0.0
        steps = delta["prefill_steps"] + delta["decode_steps"]
        text = (
            f"last {elapsed:.1f} s: prompt {delta['prompt_tokens'] / elapsed:.0f} tok/s (cache hit {hit:.1%}), "
            f"generation {delta['generated_tokens'] / elapsed:.0f} tok/s; running {stats.running}, waiting "
            f"{stats.waiting}; KV {stats.kv_usage:.1%} used; steps {steps} (prefill {delta['prefill_steps']}, "
            f"{delta['mixed_steps']} of them mixed; decode {delta['decode_steps']}); "
            f"longest step {self._longest_s * 1e3:.1f} ms; waiting on the device "
            f"{delta['device_wait_s'] / elapsed:.0%}"
        )
        if delta["device_busy_s"] > 0:
            gaps = {kind: delta[f"device_gap_{kind}_s"] / elapsed for kind in KINDS}
            before = ", ".join(f"{kind} {share:.1%}" for kind, share in gaps.items())
            text += (
                f"; device busy {delta['device_busy_s'] / elapsed:.0%}, idle between steps {sum(gaps.values()):.1%}"
                f" (before {before})"
            )
        self._since, self._last, self._longest_s, self._busy = now, stats, 0.0, False
        return text

    def maybe_log(self, stats: Callable[[], EngineStats]) -> None:
        """Log the interval's line when one is due; `stats()` is called only then."""
        if self.due():
            logger.info(self.line(stats()))
