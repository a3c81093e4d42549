"""Waiting-queue order.

`lpm` (longest prefix match): requests whose prompt shares the longest prefix
with the radix cache go first, so cached pages are reused before they are
evicted; ties keep arrival order. For long queues matching every request each
step costs too much, so lpm falls back to fcfs beyond `LPM_MAX_QUEUE`, as
SGLang does. `fcfs`: arrival order.
"""
from __future__ import annotations

from typing import Callable, List

from engine.request import Req

LPM_MAX_QUEUE = 128


def order_waiting_queue(queue: List[Req], policy: str, match_len: Callable[[Req], int]) -> List[Req]:
    """Return the queue in the order the prefill adder should try it (stable)."""
    if policy == "fcfs" or len(queue) > LPM_MAX_QUEUE:
        return list(queue)
    if policy == "lpm":
        lens = {id(r): match_len(r) for r in queue}
        return sorted(queue, key=lambda r: -lens[id(r)])
    raise ValueError(f"unknown schedule policy {policy!r}")
