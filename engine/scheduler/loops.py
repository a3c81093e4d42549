"""The scheduler's two loops, side by side: each runs the same stages of a Scheduler (scheduler.py),

    process_aborts → reserve_receives → next_batch → prepare → run → commit_forward → process_tokens

in a different order. `SerialLoop` finishes each batch before planning the next
(EngineConfig.disable_overlap_schedule). `OverlapLoop` (the default) is overlap scheduling: the CPU plans
and launches batch N+1 while the device still runs batch N.

One step of the overlap loop (one thread; on CUDA the launch is asynchronous, so the device works
while the CPU goes on):

    [sync first if batch N needs it] → aborts → plan N+1 → prepare N+1 (decode inputs of requests in N
    read N's sampled-token tensor on the device) → launch N+1 → resolve N (the GPU→CPU sync) →
    process N's tokens (detokenize, stop checks, stream, finish, release, radix inserts)

Invariant — what batch N+1 may depend on while N is unresolved:
  - N's KV bookkeeping, which does not depend on its tokens: positions computed (`kv_len`), the chunked
    request's prefix in the cache, prefilled requests in the running batch (`Scheduler.commit_forward`,
    applied when N is launched);
  - N's sampled tokens only as device tensors: a decode input (FutureMap) and the sampling step
    (len(output_ids) + 1 for a request with a token in flight, so seeded sampling draws as without overlap).
It may not read N's tokens on the CPU. (A mixed EXTEND batch's decode rows take their input the same way.)
Hence the sync rule: N is resolved and processed *before* N+1 is planned (the plain step) when a request of N has
  - a grammar (the next bitmask needs the token),
  - a repetition / frequency / presence penalty (token statistics are built from output_ids),
  - prompt logprobs owed (the next chunk continues the logprobs processed so far).
Consequences: a request that finishes in N (EOS, stop token or string, length, grammar) or is aborted
while N runs has already been given one more step in N+1. That step's token is dropped, never streamed;
its KV slot belongs to the request (its kv_len counts it) and is freed or cached with it, so no page
leaks. Prefill batches are overlapped like decode ones; a prefilled request joins decode N+1 with its
first token as a future. Only one batch is ever in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.profiling import label
from engine.request import Req
from engine.runner.batch_result import LaunchedBatch
from engine.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:  # pragma: no cover
    from engine.scheduler.scheduler import Scheduler


def needs_sync(req: Req) -> bool:
    """True when the batch after one holding `req` must not be planned before `req`'s token is known."""
    p = req.sampling_params
    return (
        req.grammar is not None
        or p.prompt_logprobs is not None
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


@dataclass
class FutureMap:
    """Tokens sampled by the in-flight batch, still on the device, and which request owns which row."""

    tokens: torch.Tensor
    """(num sampled,) int64, device — LaunchedBatch.next_token_ids of the in-flight batch."""
    rows: Dict[Req, int] = field(default_factory=dict)
    """Sampled request → its row of `tokens` (requests hash by identity)."""

    def has(self, req: Req) -> bool:
        return req in self.rows

    def resolve_inputs(self, fb: ForwardBatch, reqs: List[Req]) -> None:
        """DECODE: input id i becomes the in-flight token of reqs[i] where it has one (a device gather;
        the host list it was built from held a stale id there)."""
        pairs = [(i, self.rows[r]) for i, r in enumerate(reqs) if r in self.rows]
        if not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.int64).to(fb.input_ids.device, non_blocking=True)
        with torch.inference_mode():
            fb.input_ids = fb.input_ids.index_copy(
                0, idx[:, 0], self.tokens.index_select(0, idx[:, 1]).to(fb.input_ids.dtype)
            )


@dataclass
class InFlight:
    """The batch launched last and not yet processed."""

    batch: ScheduleBatch
    launched: LaunchedBatch
    futures: FutureMap
    detached: List[Req]
    """Sampled requests that are in no queue while the batch runs (a sender's requests, requests certain to finish):
    an abort must still find them."""
    sync: bool
    """Some request needs its token before the next batch is planned (see `needs_sync`)."""


class SerialLoop:
    """One batch at a time: planned, run, its results processed before the next is planned."""

    inflight: Optional[InFlight] = None
    """Never a batch in flight between steps."""

    def __init__(self, scheduler: "Scheduler"):
        self.s = scheduler

    def detached(self) -> List[Req]:
        return []

    def step(self) -> bool:
        """Run one batch. False when there was nothing to do."""
        s = self.s
        with label("plan"):
            s.process_aborts()
            reserved = s.reserve_receives()
            batch = s.next_batch()
        if batch is None:
            s.runner.device_clock.break_chain()
            return reserved
        with label("prepare"):
            batch.prepare(s.kv, s.runner.device)
        with label("launch"):
            launched = s.runner.launch_batch(batch)
        with label("resolve"):
            result = launched.resolve()
        with label("process"):
            s.commit_forward(batch)
            s.process_tokens(batch, result)
        return True


class OverlapLoop:
    """The scheduler's stages with one batch in flight (overlap scheduling, see the module's docstring)."""

    def __init__(self, scheduler: "Scheduler"):
        self.s = scheduler
        self.inflight: Optional[InFlight] = None

    def detached(self) -> List[Req]:
        """Unfinished requests that only the in-flight batch refers to."""
        return [r for r in self.inflight.detached if not r.finished] if self.inflight is not None else []

    def step(self) -> bool:
        """Plan and launch one batch, then process the previous one. False when there was nothing to do."""
        s = self.s
        synced = self.inflight is not None and self.inflight.sync and self._process_inflight()
        with label("plan"):
            s.process_aborts()
            reserved = s.reserve_receives()
            batch = s.next_batch()
        if batch is None:  # nothing to overlap with: finish the batch in flight now
            s.runner.device_clock.break_chain()  # the device's wait for the next batch is no gap
            return self._process_inflight() or reserved or synced
        previous, self.inflight = self.inflight, self._launch(batch)
        if previous is not None:
            self._process(previous)
        return True

    def _launch(self, batch: ScheduleBatch) -> InFlight:
        s = self.s
        futures = self.inflight.futures if self.inflight is not None else None
        with label("prepare"):
            batch.prepare(s.kv, s.runner.device)
            if futures is not None:
                # Decode rows come first in a mixed EXTEND batch, one token each: rows 0..d-1 as in DECODE.
                decoding = batch.reqs if batch.mode is ForwardMode.DECODE else batch.decode_reqs
                futures.resolve_inputs(batch.forward_batch, decoding)
                if batch.mode is ForwardMode.EXTEND and any(futures.has(r) for r in batch.prefill_reqs):
                    raise RuntimeError("a prefill planned for a request whose token is in flight (scheduler bug)")
        steps = [len(r.output_ids) + (futures is not None and futures.has(r)) for r in batch.sampled_reqs]
        with label("launch"):
            launched = s.runner.launch_batch(batch, steps)
        s.commit_forward(batch)
        detached = []
        if batch.mode is ForwardMode.EXTEND:
            running = set(map(id, s.running))
            detached = [r for r in batch.sampled_reqs if id(r) not in running]
        futures = FutureMap(launched.next_token_ids, {r: i for i, r in enumerate(batch.sampled_reqs)})
        return InFlight(batch, launched, futures, detached, any(needs_sync(r) for r in batch.reqs))

    def _process_inflight(self) -> bool:
        """Resolve and process the batch in flight, if any. Returns True when there was one."""
        inflight, self.inflight = self.inflight, None
        if inflight is None:
            return False
        self._process(inflight)
        return True

    def _process(self, inflight: InFlight) -> None:
        """Wait for a launched batch's results and process them."""
        with label("resolve"):
            result = inflight.launched.resolve()
        with label("process"):
            self.s.process_tokens(inflight.batch, result)
