"""cluster.workers.early_prefill.StartedPrompts: prompts a prefill replica started for the ingress
(early_prefill) are claimed once by the decode replica's prefill call, dropped when forgotten or
unclaimed for their TTL, and not started beyond the token limit. The engine is a stand-in recording
what is asked of it (tests/cluster/test_disaggregated.py runs the whole path with the real one)."""

import asyncio
from types import SimpleNamespace

from cluster.workers.early_prefill import StartedPrompts
from cluster.workers.stats import EarlyPrefillCounters
from engine.sampling_params import SamplingParams


class Engine:
    """prefill_for_handoff finishes when the test sets `done`; cancelling it counts as an abort."""

    def __init__(self):
        self.done, self.started, self.aborted, self.released = asyncio.Event(), [], [], []

    async def prefill_for_handoff(self, input_ids, params, rid):
        self.started.append(rid)
        try:
            await self.done.wait()
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        return SimpleNamespace(rid=rid)

    def release_handoff(self, rid):
        self.released.append(rid)


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_claim_takes_the_started_prompt_once():
    async def run():
        prompts, params = StartedPrompts(Engine(), 500, 30.0), SamplingParams(seed=7)
        prompts.start([1, 2, 3], params, "k1")
        prompts.start([1, 2, 3], params, "k1")  # a repeat is ignored
        await _settle()
        assert prompts.engine.started == ["k1"] and prompts.stats().held == 1
        started = prompts.claim("k1", [1, 2, 3], SamplingParams(seed=7))
        assert started is not None and prompts.claim("k1", [1, 2, 3], params) is None
        prompts.engine.done.set()
        assert (await started.task).rid == "k1"
        prompts.start([1, 2, 3], params, "k1")  # late: already claimed
        assert prompts.stats() == EarlyPrefillCounters(started=1, claimed=1, dropped=0, skipped=0, held=0)
        assert prompts.engine.released == []  # the claimer releases the hold after its transfer

    asyncio.run(run())


def test_claim_with_other_inputs_drops_the_started_prompt():
    async def run():
        prompts = StartedPrompts(Engine(), 500, 30.0)
        prompts.start([1, 2, 3], SamplingParams(seed=1), "k")
        await _settle()
        assert prompts.claim("k", [1, 2, 3], SamplingParams(seed=2)) is None  # other params: computed anew
        await _settle()
        assert prompts.engine.aborted == ["k"] and prompts.stats().dropped == 1

    asyncio.run(run())


def test_forget_aborts_a_running_prompt_and_releases_a_finished_one():
    async def run():
        prompts = StartedPrompts(Engine(), 500, 30.0)
        prompts.start([1], SamplingParams(), "ka")
        await _settle()
        prompts.forget("ka")  # still computing: aborted
        await _settle()
        assert prompts.engine.aborted == ["ka"]
        prompts.engine.done.set()
        prompts.start([2], SamplingParams(), "kb")
        await _settle()
        prompts.forget("kb")  # computed and held: its hold is released
        prompts.forget("kb")  # idempotent
        assert prompts.engine.released == ["kb"] and prompts.stats().dropped == 2
        assert prompts.stats().held == 0
        prompts.start([2], SamplingParams(), "kb")  # a start after the forget is ignored
        assert prompts.stats().started == 2

    asyncio.run(run())


def test_unclaimed_prompts_expire():
    async def run():
        prompts = StartedPrompts(Engine(), 500, 0.2)
        prompts.engine.done.set()
        prompts.start([1, 2], SamplingParams(), "k")
        await asyncio.sleep(1.5)  # the sweeper wakes every second
        assert prompts.engine.released == ["k"] and prompts.stats().held == 0
        assert prompts.stats().dropped == 1

    asyncio.run(run())


def test_prompts_beyond_the_limit_start_only_when_claimed():
    async def run():
        prompts = StartedPrompts(Engine(), 50, 30.0)
        prompts.start(list(range(30)), SamplingParams(), "ka")
        prompts.start(list(range(30)), SamplingParams(), "kb")  # 60 > 50 tokens: skipped
        await _settle()
        assert prompts.engine.started == ["ka"] and prompts.stats().skipped == 1
        assert prompts.claim("kb", list(range(30)), SamplingParams()) is None  # its claim computes it
        assert prompts.claim("ka", list(range(30)), SamplingParams()) is not None
        prompts.start(list(range(40)), SamplingParams(), "kc")  # the claim freed its tokens
        await _settle()
        assert prompts.engine.started == ["ka", "kc"]

    asyncio.run(run())
