"""Scheduler: continuous batching over one ModelRunner.

One step reads like the loop of SGLang's scheduler:

    process aborts → plan a batch (prefill first, else decode) → run it → process results

Prefill has priority: when waiting requests fit, the step is a prefill batch
(possibly ending with one chunked request, which continues next step before
anything else); otherwise the running requests decode one token each. With
`enable_mixed_chunk`, a prefill step also carries one decode token of every
running request (SGLang's mixed chunked prefill), so that prompts arriving
under load do not stall the running batch; the step's token budget
(`max_prefill_tokens`) then counts those decode tokens too. When a
decode step cannot get KV pages, requests are retracted (their computed KV goes
to the radix cache, they return to the waiting queue and resume later with
unchanged output). The scheduler is single-threaded: the Engine calls `step()`
from its loop thread and feeds requests and aborts through its own queue.

This class owns the queues and the stages of a step (process_aborts,
reserve_receives, next_batch, commit_forward, process_tokens); loops.py runs them:
SerialLoop one batch after the other, OverlapLoop (the default) with batch N+1
launched before batch N's results are processed.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from engine.forward_batch import ForwardMode
from engine.memory.kv_cache_manager import KVCacheManager
from engine.memory.radix_cache import CacheStats
from engine.outputs import EngineStats, FinishReason, TokenLogprob
from engine.request import Req
from engine.scheduler.decode import retract_for_decode
from engine.scheduler.handoff import HandoffState
from engine.scheduler.output import OutputProcessor
from engine.scheduler.loops import OverlapLoop, SerialLoop
from engine.scheduler.policy import LPM_MAX_QUEUE, InBatchPrefixIndex, order_waiting_queue
from engine.scheduler.prefill import PrefillAdder
from engine.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner, kv: KVCacheManager, config, context_len: int):
        self.runner = runner
        self.kv = kv
        self.config = config
        self.context_len = context_len
        self.waiting: List[Req] = []
        self.running: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.output = OutputProcessor(context_len)
        self.counters: Dict[str, int] = dict(
            prompt_tokens=0,
            cached_tokens=0,
            generated_tokens=0,
            retractions=0,
            finished=0,
            aborted=0,
            prefill_steps=0,
            decode_steps=0,
            mixed_steps=0,
        )
        self.device_wait_s = 0.0
        """Seconds spent blocked on the device's results (EngineStats.device_wait_s)."""
        self.handoff = HandoffState(kv, self.output, self.counters, config.new_token_ratio)
        """Disaggregation: requests receiving or sending their prompt's KV (never in waiting/running)."""
        self.loop = SerialLoop(self) if config.disable_overlap_schedule else OverlapLoop(self)
        """What runs the stages (loops.py): OverlapLoop launches batch N+1 before processing batch N's results."""

    # ---- inputs --------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        if req.handoff == "receiver":
            self.handoff.pending.append(req)
        else:
            self.waiting.append(req)

    def complete_receive(self, rid: str, handoff) -> None:
        """Disaggregation, receiver: the prompt's KV of `rid` has landed (see handoff.py)."""
        req = self.handoff.complete_receive(rid, handoff)
        if req is not None:
            self.running.append(req)

    def release_sent(self, rid: str) -> None:
        """Disaggregation, sender: the transfer of `rid` is over; its KV goes to the radix cache."""
        self.handoff.release_sent(rid)

    def abort(self, rid: str) -> None:
        """Mark every request with this rid (or `rid-<i>` children of an n > 1 group) for abort."""
        for req in self._all_reqs():
            if req.rid == rid or req.rid.startswith(rid + "#"):
                req.to_abort = True

    def drop_all(self) -> List[Req]:
        """Forget every request (the engine is going down); returns them. Their pages are not freed."""
        reqs = self._all_reqs()
        self.waiting.clear()
        self.running.clear()
        self.chunked_req = None
        return reqs

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self.chunked_req or self.handoff.pending or self.loop.inflight is not None
        )

    def _all_reqs(self) -> List[Req]:
        return (
            self.waiting
            + self.running
            + ([self.chunked_req] if self.chunked_req else [])
            + self.handoff.reqs()
            + self.loop.detached()
        )

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> bool:
        """Run one step of the loop (one batch). Returns False when there was nothing to do."""
        return self.loop.step()

    # ---- the stages of a step (run by loops.py) ------------------------------------------
    def reserve_receives(self) -> bool:
        """Disaggregation, receiver: reserve pages for prompts to receive. True when it did any."""
        return bool(self.handoff.pending) and self.handoff.reserve_receives(self.running)

    def next_batch(self) -> Optional[ScheduleBatch]:
        """The next batch: a prefill (mixed, with `enable_mixed_chunk`) when waiting requests fit, else a
        decode of the running requests; None when there is nothing to run."""
        return self._get_new_prefill_batch() or self._get_decode_batch()

    def process_aborts(self) -> None:
        """End every request marked for abort: out of its queue, its pages freed, its caller told."""
        for req in [r for r in self._all_reqs() if r.to_abort]:
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.running.remove(req)
            if req is self.chunked_req:
                self.chunked_req = None
            self.handoff.forget(req)
            self.kv.release(req, cache=False)
            self.counters["aborted"] += 1
            self.output.finish(req, FinishReason.ABORT)

    def _get_new_prefill_batch(self) -> Optional[ScheduleBatch]:
        decoding = self._decoding_reqs() if self.config.enable_mixed_chunk and self.running else []
        adder = PrefillAdder(
            self.kv,
            self.running,
            self.config.max_prefill_tokens,
            self.config.chunked_prefill_size,
            self.config.new_token_ratio,
            self.config.max_running_requests,
            decoding,
        )
        # Like lpm ordering itself, the in-batch check is skipped for long queues (it costs a tree walk per request).
        use_in_batch = self.config.schedule_policy == "lpm" and self.kv.use_tree and len(self.waiting) <= LPM_MAX_QUEUE
        in_batch = InBatchPrefixIndex() if use_in_batch else None
        if self.chunked_req is not None:
            if not adder.add_one(self.chunked_req, admitted=True):
                return None
            if in_batch is not None:
                in_batch.add(self.chunked_req.fill_ids)
            self.chunked_req = None
        queue = order_waiting_queue(
            [r for r in self.waiting if self._ready(r)], self.config.schedule_policy, self.kv.match
        )
        for req in queue:
            if in_batch is not None and in_batch.should_wait(req.fill_ids, self.kv.match(req)):
                continue
            if adder.full or not adder.add_one(req, admitted=False):
                break
            if in_batch is not None:
                in_batch.add(req.fill_ids)
            self.waiting.remove(req)
            if req.num_retractions == 0 and not req.output_ids:
                self.counters["prompt_tokens"] += len(req.origin_input_ids)
                self.counters["cached_tokens"] += req.prefix_len
                req.cached_tokens = req.prefix_len
        if not adder.can_run:
            return None
        self.chunked_req = adder.chunked_req
        for req in decoding:
            req.extend_len = 1
        return ScheduleBatch(
            ForwardMode.EXTEND, decoding + adder.can_run, chunked_req=adder.chunked_req, num_decode=len(decoding)
        )

    @staticmethod
    def _ready(req: Req) -> bool:
        """An n > 1 sibling waits until the first of its group has its prompt cached."""
        first = req.wait_for
        if first is None or first.prompt_done or first.finished:
            req.wait_for = None
            return True
        return False

    def _decoding_reqs(self) -> List[Req]:
        """The running requests that decode a token this step, after retracting those whose next page
        cannot be had (they return to the front of the waiting queue)."""
        retracted = retract_for_decode(self.running, self.kv, self.output, self.context_len)
        for req in retracted:
            self.counters["retractions"] += 1
            if not req.finished:
                self.waiting.insert(0, req)
        return list(self.running)

    def _get_decode_batch(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        decoding = self._decoding_reqs()
        if not decoding:
            return None
        for req in decoding:
            req.extend_len = 1
        return ScheduleBatch(ForwardMode.DECODE, decoding)

    def commit_forward(self, batch: ScheduleBatch) -> None:
        """What a launched forward changes, whatever tokens it samples: the computed positions, the
        chunked request's prefix shared through the cache, and prefilled requests joining the running
        batch (except a sender's requests and those certain to finish with this token). Overlap scheduling calls it
        at launch, before the tokens are known; one that then finishes leaves in `process_tokens`."""
        for req in batch.reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
        if batch.chunked_req is not None:
            self.kv.cache_unfinished(batch.chunked_req)
        if batch.mode is ForwardMode.EXTEND:
            for req in batch.sampled_reqs[batch.num_decode :]:  # decode rows of a mixed batch already run
                if req.handoff != "sender" and len(req.output_ids) + 1 < req.sampling_params.max_new_tokens:
                    self.kv.cache_unfinished(req)
                    self.running.append(req)

    def process_tokens(self, batch: ScheduleBatch, result) -> None:
        """Append the sampled tokens, finish, release and stream. A request already finished (overlap:
        it ended or was aborted while this batch ran) gets nothing: its extra token is dropped."""
        self.counters["prefill_steps" if batch.mode is ForwardMode.EXTEND else "decode_steps"] += 1
        self.counters["mixed_steps"] += batch.num_decode > 0
        self.device_wait_s += result.device_wait_s
        live = [r for r in batch.reqs if not r.finished]
        for i, lps in result.prompt_logprobs.items():
            batch.reqs[i].prompt_logprobs += lps
        for i, req in enumerate(batch.sampled_reqs):
            if req.finished:
                continue
            if req.handoff == "sender":
                self._send(req, result, i)
                continue
            self.output.append_token(req, result, i)
            self.counters["generated_tokens"] += 1
            if req.finished:
                self.kv.release(req, cache=True)
                self.counters["finished"] += 1
                if req in self.running:
                    self.running.remove(req)
                elif req in self.waiting:  # overlap: retracted while its token was in flight
                    self.waiting.remove(req)
        self.output.flush(live)

    def _send(self, req: Req, result, row: int) -> None:
        """Sender: hand the computed prompt over instead of decoding it here."""
        token = result.next_token_ids[row]
        logprob = None
        if result.logprobs is not None:
            logprob = TokenLogprob(token, result.logprobs[row], result.top_logprobs[row])
        self.handoff.send(req, token, logprob)

    # ---- introspection ------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Counters, the device's wait and busy time and the radix cache's hit counts start from zero again
        (after a warm-up: engine/core/warmup.py)."""
        for key in self.counters:
            self.counters[key] = 0
        self.device_wait_s = 0.0
        self.runner.device_clock.reset()
        self.kv.tree.stats = CacheStats()

    def stats(self) -> EngineStats:
        alloc, tree = self.kv.allocator, self.kv.tree
        used = alloc.size - alloc.available_size() - tree.evictable_size()
        prompt = self.counters["prompt_tokens"]
        return EngineStats(
            running=len(self.running) + (1 if self.chunked_req else 0),
            waiting=len(self.waiting) + len(self.handoff.pending),
            handoff_in_flight=len(self.handoff.awaiting) + len(self.handoff.held),
            kv_total_tokens=alloc.size,
            kv_free_tokens=alloc.available_size(),
            kv_cached_tokens=tree.total_size(),
            kv_evictable_tokens=tree.evictable_size(),
            kv_usage=used / alloc.size,
            cache_hit_rate=(self.counters["cached_tokens"] / prompt) if prompt else 0.0,
            device_wait_s=self.device_wait_s,
            device_busy_s=self.runner.device_clock.busy_s(),
            **{f"device_gap_{kind}_s": seconds for kind, seconds in self.runner.device_clock.gap_s().items()},
            **self.counters,
        )
