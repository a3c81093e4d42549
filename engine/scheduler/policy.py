"""Waiting-queue order.

`lpm` (longest prefix match): requests whose prompt shares the longest prefix
with the radix cache go first, so cached pages are reused before they are
evicted; ties keep arrival order. For long queues matching every request each
step costs too much, so lpm falls back to fcfs beyond `LPM_MAX_QUEUE`, as
SGLang does. Under lpm, a request that shares a long uncached prefix with one
already in the batch being planned waits a step (InBatchPrefixIndex), so the
prefix is computed once and then reused. `fcfs`: arrival order.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from engine.memory.radix_cache import RadixCache
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


# A waiting request sharing at least this many not-yet-cached tokens with a request already in
# the prefill batch being planned waits one step (SGLang uses the same threshold).
IN_BATCH_SHARE_THRESHOLD = 32


class _NoFree:
    """The in-batch index never evicts, so it never frees slots."""

    def free(self, indices: torch.Tensor) -> None:  # pragma: no cover - never called
        raise AssertionError("the in-batch prefix index holds no KV slots")


class InBatchPrefixIndex:
    """Prompts of the prefill batch being planned (under `lpm`).

    Without it, requests of one group submitted together (a shared system prompt,
    n > 1 siblings) would all compute the shared prefix in the same batch. With it,
    one computes and caches the prefix and the others reuse it a step later.
    Token ids only: the values stored in its tree are placeholders.
    """

    def __init__(self) -> None:
        self._tree = RadixCache(_NoFree(), page_size=1, enable_events=False)

    def should_wait(self, ids: List[int], cached_len: int) -> bool:
        shared = self._tree.match_prefix(ids, record_stats=False).prefix_len
        return shared - cached_len >= IN_BATCH_SHARE_THRESHOLD

    def add(self, ids: List[int]) -> None:
        self._tree.insert(ids, torch.zeros(len(ids), dtype=torch.int64))
