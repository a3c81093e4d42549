"""Mixed chunked prefill (EngineConfig.enable_mixed_chunk): a prompt that arrives while others decode is
computed in the same step as their next tokens. Greedy outputs must not change (docs/design.md), with and
without overlap scheduling, with pages of 1 and 16 tokens and with prompts chunked over several steps;
no page may leak."""

import pytest

from engine_harness import PROMPTS, assert_no_leak, make_engine
from engine.core.messages import AddRequest
from engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(default_engine):
    return {p: o.token_ids for p, o in zip(PROMPTS, default_engine.generate(PROMPTS, GREEDY))}


def _staggered(engine, every: int):
    """Inside the loop thread: add PROMPTS[i] after i * `every` steps, step until idle. Returns the
    output ids per prompt and the steps that mixed decodes into a prefill."""
    core = engine.local_core
    outputs = {}

    def collect(out):
        outputs.setdefault(out.rid, []).extend(out.new_token_ids)

    def scenario():
        pending, steps = list(enumerate(PROMPTS)), 0
        while pending or core.scheduler.has_work:
            while pending and pending[0][0] * every <= steps:
                i, prompt = pending.pop(0)
                (req,) = core._make_group(
                    AddRequest(f"r{i}", engine.tokenizer.encode(prompt), SamplingParams(**GREEDY), 0)
                )
                req.on_output = collect
                core.scheduler.add_request(req)
            core.scheduler.step()
            steps += 1
        return core.scheduler.counters["mixed_steps"]

    # The scenario is the whole generation (tens of steps of the default model) in one call: its bound is
    # for a hang, not for a CPU that other tests share.
    mixed = engine._call(scenario, timeout=600.0)
    return {PROMPTS[int(rid[1:])]: ids for rid, ids in outputs.items()}, mixed


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(disable_overlap_schedule=True),
        dict(page_size=16, chunked_prefill_size=16),
    ],
)
def test_mixed_steps_leave_greedy_outputs_unchanged(reference, options):
    engine = make_engine(enable_mixed_chunk=True, **options)
    try:
        got, mixed = _staggered(engine, every=3)
        assert mixed > 0, "no prefill ran beside a decoding request: the test exercised nothing"
        assert got == reference
        assert_no_leak(engine)
    finally:
        engine.shutdown()
