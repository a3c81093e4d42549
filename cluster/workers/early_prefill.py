"""StartedPrompts: prompts a prefill replica started before the decode replica's call for them came.

With early_prefill the ingress sends each prompt to its prefill replica (start_prefill) while the decode
replica reserves pages; the decode replica's prefill call then claims the started prompt by its key, so
the prompt computes during the reservation and the call's transport (docs/disaggregation.md).

    start(key) ──▶ engine.prefill_for_handoff(rid=key)  (computing, then holding its KV pages)
    claim(key) ──▶ the started prompt, for the prefill call that writes it (and releases the hold)
    forget(key) / unclaimed for `ttl_s` ──▶ dropped: aborted while computing, else its hold released

Invariants: a key is started at most once and claimed or dropped at most once (ended keys are
remembered for an hour, so a late start is ignored); every started prompt is claimed or dropped, so
its engine request always ends; started prompts never hold more than `limit_tokens` prompt tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from cluster.workers.stats import EarlyPrefillCounters

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

_ENDED_TTL_S = 3600.0


@dataclass
class StartedPrompt:
    task: "asyncio.Future"
    """engine.prefill_for_handoff(...) → SenderHandoff; cancelling it aborts the engine request."""
    engine_rid: str
    signature: tuple
    """(input_ids, params) it was started with: a claim must match them."""
    started: float
    """time.monotonic() at start."""


class StartedPrompts:
    """The started prompts of one prefill replica (its event loop's thread only)."""

    def __init__(self, engine: Any, limit_tokens: int, ttl_s: float):
        """`engine`: the replica's engine.Engine; `limit_tokens`: most prompt tokens started and not yet
        claimed; `ttl_s`: a started prompt not claimed in this time is dropped (its decode replica's
        call is not coming)."""
        self.engine, self.limit_tokens, self.ttl_s = engine, limit_tokens, ttl_s
        self._started: Dict[str, StartedPrompt] = {}
        self._ended: Dict[str, float] = {}
        """Keys claimed or dropped → time.monotonic()."""
        self._held_tokens = 0
        self._counts = EarlyPrefillCounters()
        """Sums so far (its `held` stays 0: stats() sets it)."""
        self._sweeper: Optional["asyncio.Future"] = None

    def stats(self) -> EarlyPrefillCounters:
        """The counters now, `held` being the prompts started and neither claimed nor dropped."""
        return dataclasses.replace(self._counts, held=len(self._started))

    def start(self, input_ids: List[int], params: SamplingParams, key: str) -> None:
        """Start computing the prompt under `key` (returns at once); ignored for a key seen before."""
        if key in self._started or key in self._ended:
            return
        # Started prompts hold the pool until claimed, and a claim waits for its decode replica's pages.
        # Were the pool full of them while a claimed prompt needs room here and their decode replicas are
        # full too, nothing would move until they expire: the rest of the pool stays for prompts started
        # by a claim (beyond the limit, this one starts when its claim comes, as with early_prefill off).
        if self._held_tokens + len(input_ids) > self.limit_tokens:
            self._counts = self._counts.plus(skipped=1)
            return
        task = asyncio.ensure_future(self.engine.prefill_for_handoff(input_ids, params, rid=key))
        task.add_done_callback(_retrieve)
        self._started[key] = StartedPrompt(task, key, (input_ids, params), time.monotonic())
        self._held_tokens += len(input_ids)
        self._counts = self._counts.plus(started=1)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep_loop())

    def claim(self, key: str, input_ids: List[int], params: SamplingParams) -> Optional[StartedPrompt]:
        """The prompt started under `key`, now the caller's (it must release the engine's hold), or None:
        none started, or started with other inputs (then dropped)."""
        started = self._pop(key)
        if started is None:
            return None
        if started.signature != (input_ids, params):
            logger.warning("prompt started under %s differs from its prefill call's: computed anew", key)
            self._drop(started)
            return None
        self._counts = self._counts.plus(claimed=1)
        return started

    def forget(self, key: str) -> None:
        """The request of `key` ended without a claim: drop its prompt (no-op once claimed or dropped)."""
        started = self._pop(key)
        if started is not None:
            self._drop(started)

    def _pop(self, key: str) -> Optional[StartedPrompt]:
        self._ended[key] = time.monotonic()
        started = self._started.pop(key, None)
        if started is not None:
            self._held_tokens -= len(started.signature[0])
        return started

    def _drop(self, started: StartedPrompt) -> None:
        """Free an unclaimed prompt's engine request (computing: aborted; done: its hold released)."""
        self._counts = self._counts.plus(dropped=1)
        if not started.task.done():
            started.task.cancel()
        elif not started.task.cancelled() and started.task.exception() is None:
            self.engine.release_handoff(started.engine_rid)

    async def _sweep_loop(self) -> None:
        """While keys are known: drop prompts unclaimed after ttl_s, forget ended keys after an hour."""
        while self._started or self._ended:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for key in [k for k, s in self._started.items() if now - s.started > self.ttl_s]:
                logger.warning("prompt started under %s was not claimed in %.0f s: dropped", key, self.ttl_s)
                self.forget(key)
            self._ended = {k: t for k, t in self._ended.items() if now - t < _ENDED_TTL_S}


def _retrieve(task: "asyncio.Future") -> None:
    """Done callback: mark a task's exception as retrieved (its owner may never await it)."""
    if not task.cancelled():
        task.exception()
