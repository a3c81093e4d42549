"""Text made outside the engine: an engine with detokenize=False streams token ids only, and
engine.text.OutputText turns them into exactly the text, stop point and token counts that an
engine which detokenizes itself returns (the greedy-output invariant, docs/design.md)."""

import asyncio
import dataclasses

import pytest

from engine.text import OutputText
from engine_harness import assert_no_leak, make_engine
from engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def token_engine():
    engine = make_engine(detokenize=False)
    yield engine
    engine.shutdown()


def _stream(engine, ids, params):
    async def run():
        return [out async for out in engine.generate_stream(ids, params)]

    return asyncio.run(run())


def _made_here(raw, tokenizer, ids, params, chunk: int):
    """A token-only engine's outputs `raw` through OutputText, regrouped `chunk` outputs per message (as a
    worker coalesces engine steps), per choice: (text, finish_reason, matched_stop, completion_tokens,
    token ids)."""
    text = OutputText(tokenizer, ids, params)
    merged = []
    for index in range(params.n):  # coalesce runs of one choice's outputs into one, like a late reader
        mine = [o for o in raw if o.index == index]
        for k in range(0, len(mine), chunk):
            group = mine[k : k + chunk]
            merged.append(
                dataclasses.replace(
                    group[-1],
                    new_token_ids=[t for o in group for t in o.new_token_ids],
                    logprobs=None if group[0].logprobs is None else [lp for o in group for lp in o.logprobs],
                )
            )
    out, texts, token_ids = {}, {}, {}
    for o in merged:
        o = text.apply(o)
        if o is None:
            continue
        text_so_far, ids_so_far = texts.get(o.index, ""), token_ids.get(o.index, [])
        texts[o.index], token_ids[o.index] = text_so_far + o.text, ids_so_far + o.new_token_ids
        out[o.index] = (texts[o.index], o.finish_reason, o.matched_stop, o.completion_tokens, token_ids[o.index])
        if o.logprobs is not None:
            assert len(o.logprobs) == len(o.new_token_ids)
    assert text.finished
    return [out[i] for i in range(params.n)]


def test_token_only_engine_streams_ids_without_text(token_engine, default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=["the"])  # no text: ignored
    outs = _stream(token_engine, ids, params)
    assert all(o.text == "" for o in outs)
    got = [t for o in outs for t in o.new_token_ids]
    want = default_engine.generate(ids, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    assert got == want.token_ids and outs[-1].finish_reason == "length"
    assert_no_leak(token_engine)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0, max_new_tokens=32, ignore_eos=True),
        dict(temperature=0.9, seed=5, n=2, max_new_tokens=32, ignore_eos=True, logprobs=True, top_logprobs=2),
    ],
)
def test_output_text_equals_the_engine_with_and_without_stop_strings(token_engine, default_engine, sampling):
    ids = default_engine.tokenizer.encode(PROMPT)
    plain = default_engine.generate(ids, sampling)
    plain = plain if isinstance(plain, list) else [plain]
    stop = plain[0].text[len(plain[0].text) // 3 :][:4]  # a stop string inside choice 0's text
    assert stop.strip()
    for extra in ({}, {"stop": [stop, "\n\n\n\n"]}):
        params = SamplingParams(**sampling, **extra)
        want = default_engine.generate(ids, dict(sampling, **extra))
        want = want if isinstance(want, list) else [want]
        raw = _stream(token_engine, ids, params)
        for chunk in (1, 64):  # one engine step per message, and everything in one message
            got = _made_here(raw, default_engine.tokenizer, ids, params, chunk)
            assert got == [(w.text, w.finish_reason, w.matched_stop, w.completion_tokens, w.token_ids) for w in want]
            if extra:
                assert got[0][1] == "stop" and got[0][2] == stop and len(got[0][4]) < len(plain[0].token_ids)
    assert_no_leak(token_engine)


def test_outputs_after_a_stop_are_dropped(default_engine):
    tok = default_engine.tokenizer
    ids = tok.encode("a b")
    params = SamplingParams(stop=[" world"], max_new_tokens=50)
    text = OutputText(tok, ids, params)
    words = tok.encode(" hello world and more")
    from engine.engine import StreamOutput

    def out(tokens, done=None):
        return StreamOutput(
            rid="r",
            index=0,
            new_token_ids=tokens,
            text="",
            logprobs=None,
            finish_reason=done,
            matched_stop=None,
            prompt_tokens=len(ids),
            cached_tokens=0,
            completion_tokens=len(tokens),
        )

    first = text.apply(out(words))  # one message: the stop completes at " world", the rest is cut
    assert (first.text, first.finish_reason, first.matched_stop) == (" hello", "stop", " world")
    assert first.new_token_ids == tok.encode(" hello world") and first.completion_tokens == len(first.new_token_ids)
    assert text.stopped_here(first) and text.finished
    assert text.apply(out(tok.encode(" later"), done="abort")) is None  # the worker's own end is dropped
