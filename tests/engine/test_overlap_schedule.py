"""Overlap scheduling (engine/scheduler/loops.py, OverlapLoop) on the default model, CPU float32.

The same workloads run on an engine with overlap scheduling (the default) and one with
`disable_overlap_schedule=True`; every observable result must be the same: tokens, text, finish
reasons, streamed deltas, logprobs, seeded samples. After everything (aborts included) no KV page leaks.
On the CPU the overlap path is the same code as on CUDA (launch N+1, then resolve and process N); it
just does not run anything concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine_harness import PROMPTS, assert_no_leak, make_engine
from engine.core.messages import AddRequest
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams

LONG = (
    "You are a careful assistant who answers in short sentences. " * 6
    + "Question: name three rivers of Europe.\nAnswer:"
)
# Small chunks: most prompts are prefilled over several steps, some while others decode.
OPTIONS = dict(chunked_prefill_size=16, page_size=4)


@pytest.fixture(scope="module")
def engines():
    pair = {overlap: make_engine(disable_overlap_schedule=not overlap, **OPTIONS) for overlap in (True, False)}
    yield pair
    for engine in pair.values():
        engine.shutdown()


def both(engines, fn):
    """fn(engine) on the overlap engine and on the plain one: (overlap result, plain result)."""
    return fn(engines[True]), fn(engines[False])


def summary(out):
    """What a caller sees of one GenerateOutput (logprobs rounded: batch composition may move the last bits)."""
    lps = (
        None
        if out.logprobs is None
        else [(lp.token_id, round(lp.logprob, 3), [t for t, _ in lp.top_logprobs]) for lp in out.logprobs]
    )
    return (out.token_ids, out.text, out.finish_reason, out.matched_stop, out.completion_tokens, lps)


def assert_clean(engine) -> None:
    """Nothing running, every page free or cached; after dropping the cache, every page free."""
    wait_idle(engine)
    assert_no_leak(engine)
    engine.flush_cache()
    s = engine.stats()
    assert s.kv_free_tokens == s.kv_total_tokens, s


def wait_idle(engine) -> None:
    """Aborts and the dropped extra step are applied at the engine's next steps: wait (bounded) until the
    scheduler has no work, no batch in flight included."""
    for _ in range(500):
        if not engine._call(lambda: engine.scheduler.has_work):
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine did not become idle: {engine.stats()}")


MIXED = [  # one per PROMPTS entry: different lengths, limits and finish reasons in one batch
    dict(temperature=0.0, max_new_tokens=40),  # ends with EOS after 30 tokens
    dict(temperature=0.0, max_new_tokens=40, stop=["\n\n"]),
    dict(temperature=0.0, max_new_tokens=24, stop=["3."]),
    dict(temperature=0.0, max_new_tokens=1),
    dict(temperature=0.0, max_new_tokens=16, logprobs=True, top_logprobs=3),
    dict(temperature=0.0, max_new_tokens=0),
    dict(temperature=0.0, max_new_tokens=24),
    dict(temperature=0.8, top_p=0.95, seed=7, max_new_tokens=20),
]


def test_mixed_batch_identical(engines):
    prompts = PROMPTS + [LONG]
    params = MIXED + [dict(temperature=0.0, max_new_tokens=12)]  # LONG: EOS is its first token
    on, off = both(engines, lambda e: [summary(o) for o in e.generate(prompts, params)])
    assert on == off
    reasons = {o[2] for o in on}
    assert {"stop", "length"} <= reasons, reasons
    assert any(o[3] == "\n\n" or o[3] == "3." for o in on), "no stop string matched: pick other stops"
    assert on[0][2] == "stop" and isinstance(on[0][3], int), "prompt 0 should end with EOS"
    for engine in engines.values():
        assert_clean(engine)


def test_n_and_seeded_sampling_identical(engines):
    params = [
        dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234, n=3, max_new_tokens=16),
        dict(temperature=0.0, n=2, max_new_tokens=10),
    ]
    on, off = both(engines, lambda e: [summary(o) for o in e.generate([PROMPTS[3], PROMPTS[7]], params)])
    assert on == off
    assert len({tuple(o[0]) for o in on[:3]}) > 1, "the three seeded choices should differ"
    for engine in engines.values():
        assert_clean(engine)


def test_fallback_requests_identical(engines):
    """Grammar, penalties and prompt logprobs need the previous token on the CPU: their batches run the
    plain step, mixed in the same batch with requests that overlap."""
    prompts = [PROMPTS[4], PROMPTS[0], PROMPTS[3], LONG, PROMPTS[1]]
    params = [
        dict(temperature=0.0, max_new_tokens=12, regex=r"[0-9]{2,3}\n"),
        dict(temperature=0.0, max_new_tokens=12, frequency_penalty=0.8, presence_penalty=0.3),
        dict(temperature=0.7, seed=3, max_new_tokens=12, repetition_penalty=1.3),
        dict(temperature=0.0, max_new_tokens=4, prompt_logprobs=2),  # prefilled in several chunks
        dict(temperature=0.0, max_new_tokens=12),
    ]

    def run(engine):
        outs = engine.generate(prompts, params)
        plps = [(lp.token_id, round(lp.logprob, 3)) for lp in outs[3].prompt_logprobs]
        return [summary(o) for o in outs], plps

    on, off = both(engines, run)
    assert on == off
    assert len(on[1]) == len(engines[True].tokenizer.encode(LONG)) - 1
    for engine in engines.values():
        assert_clean(engine)


async def _stream(engine, prompt, params, rid, stop_after=None, abort_after=None):
    """Stream one request; (new_token_ids, text, finish_reason) per output. `stop_after`: leave the
    iterator after that many outputs (cancels: aborts). `abort_after`: call engine.abort(rid) then."""
    deltas = []
    async with contextlib.aclosing(engine.generate_stream(prompt, params, rid=rid)) as stream:
        async for out in stream:
            deltas.append((out.new_token_ids, out.text, out.finish_reason))
            if abort_after is not None and len(deltas) == abort_after:
                engine.abort(rid)
            if stop_after is not None and len(deltas) == stop_after:
                break
    return deltas


def test_streaming_deltas_identical(engines):
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[6], LONG]
    params = [MIXED[0], MIXED[2], MIXED[6], dict(temperature=0.0, max_new_tokens=10)]

    async def run(engine):
        return await asyncio.gather(
            *[_stream(engine, p, sp, f"s{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        )

    on, off = both(engines, lambda e: asyncio.run(run(e)))
    assert on == off
    for engine in engines.values():
        assert_clean(engine)


def test_aborts_mid_stream_leak_nothing(engines):
    """A request aborted while its next token is in flight gets no token after the abort; the others
    are unaffected; afterwards every page is free."""
    params = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    async def run(engine):
        return await asyncio.gather(
            _stream(engine, PROMPTS[1], params, "cancelled", stop_after=3),
            _stream(engine, PROMPTS[3], params, "aborted", abort_after=2),
            _stream(engine, LONG, params, "kept"),
        )

    full = engines[False].generate([PROMPTS[1], PROMPTS[3], LONG], params)
    for engine in engines.values():
        cancelled, aborted, kept = asyncio.run(run(engine))
        wait_idle(engine)
        assert aborted[-1][2] == "abort", aborted
        for deltas, ref in ((cancelled, full[0]), (aborted, full[1])):
            streamed = [t for ids, _, _ in deltas for t in ids]
            assert streamed == ref.token_ids[: len(streamed)]  # every streamed token is a right one
        assert [t for ids, _, _ in kept for t in ids] == full[2].token_ids
        assert_clean(engine)


def test_retraction_identical():
    """A pool too small for all requests: decode-time retraction, also of requests with a token in flight."""
    greedy = dict(temperature=0.0, max_new_tokens=16)
    results = {}
    for overlap in (True, False):
        with make_engine(
            max_total_tokens=192, page_size=16, new_token_ratio=0.0, disable_overlap_schedule=not overlap
        ) as engine:
            results[overlap] = [summary(o) for o in engine.generate(PROMPTS, greedy)]
            assert engine.stats().retractions > 0
            assert_clean(engine)
    assert results[True] == results[False]


def test_next_batch_is_launched_before_the_previous_is_processed(engines):
    """The order of launches (L) and result processing (P), and where decode inputs come from: with
    overlap, decode batch k+1 is launched before batch k is processed, while its input token is only on
    the device (the request's kv_len already counts every token the host knows)."""

    def record(engine):
        events, runner, scheduler = [], engine.runner, engine.scheduler
        launch, process = runner.launch_batch, scheduler.process_tokens

        def traced_launch(batch, *args):
            events.append(("L", id(batch), [r.seq_len - r.kv_len for r in batch.reqs]))
            return launch(batch, *args)

        def traced_process(batch, result):
            events.append(("P", id(batch), None))
            return process(batch, result)

        engine._call(
            lambda: (
                setattr(runner, "launch_batch", traced_launch),
                setattr(scheduler, "process_tokens", traced_process),
            )
        )
        try:
            out = engine.generate(PROMPTS[0], dict(temperature=0.0, max_new_tokens=6, ignore_eos=True))
            wait_idle(engine)  # the extra step's batch has been processed too
        finally:
            engine._call(lambda: (vars(runner).pop("launch_batch"), vars(scheduler).pop("process_tokens")))
        return out.token_ids, events

    (ids_on, on), (ids_off, off) = both(engines, record)
    assert ids_on == ids_off
    kinds_off = [k for k, _, _ in off]
    assert kinds_off == ["L", "P"] * (len(off) // 2)
    kinds_on = [k for k, _, _ in on]
    # L1 L2 P1 L3 P2 ... : the extra step (the request already finished) is launched and then dropped
    assert kinds_on[:3] == ["L", "L", "P"] and kinds_on.count("L") == kinds_off.count("L") + 1, kinds_on
    assert all(gap == [0] for k, _, gap in on[1:] if k == "L"), on  # input token in flight
    assert all(gap == [1] for k, _, gap in off[1:] if k == "L"), off  # input token on the host


@pytest.mark.parametrize("handoff", [None, "sender"])
def test_abort_reaches_a_request_only_in_flight(engines, handoff):
    """A request whose prefill is in flight and that joined no queue (it finishes with its first token, or
    it is a disaggregation sender's) is still found by an abort: no token, no handoff, no page kept. The
    scheduler is driven step by step inside the engine's loop thread."""
    engine, outputs = engines[True], []
    scheduler = engine.scheduler

    def scenario():
        params = SamplingParams(temperature=0.0, max_new_tokens=1 if handoff is None else 8)
        (req,) = engine.local_core._make_group(
            AddRequest("solo", engine.tokenizer.encode(PROMPTS[0]), params, 0, handoff)
        )
        req.on_output = outputs.append
        scheduler.add_request(req)
        assert scheduler.step()  # its prefill is launched, not processed
        detached = scheduler.loop.detached()
        scheduler.abort("solo")
        while scheduler.step():
            pass
        return detached == [req], req.output_ids

    only_in_flight, output_ids = engine._call(scenario)
    assert only_in_flight
    assert output_ids == [] and [(o.new_token_ids, o.finish_reason, o.handoff) for o in outputs] == [
        ([], FinishReason.ABORT, None)
    ]
    assert engine.stats().handoff_in_flight == 0
    assert_clean(engine)


def test_future_map_feeds_in_flight_tokens_on_the_device():
    """FutureMap.resolve_inputs: rows of requests with a token in flight take it from the device tensor;
    the others keep their host ids. needs_sync names the requests that must not overlap."""
    import torch

    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.request import Req
    from engine.sampling_params import SamplingParams
    from engine.scheduler.loops import FutureMap, needs_sync

    def req(**params):
        return Req("r", [1, 2], SamplingParams(**params), 0, frozenset(), lambda out: None)

    a, b, c = req(), req(), req(frequency_penalty=0.5)
    futures = FutureMap(torch.tensor([70, 71, 72]), {a: 2, c: 0})
    fb = ForwardBatch.build(
        ForwardMode.DECODE,
        [5, 6, 7],
        [2, 2, 2],
        torch.tensor([8, 9, 10]),
        [0, 1, 2],
        [3, 3, 3],
        [2, 2, 2],
        torch.device("cpu"),
    )
    futures.resolve_inputs(fb, [b, a, c])
    assert fb.input_ids.tolist() == [5, 72, 70]
    assert [needs_sync(r) for r in (a, c, req(repetition_penalty=1.1), req(prompt_logprobs=0))] == [
        False,
        True,
        True,
        True,
    ]
