"""Engine API: sampling features, streaming, abort, finish reasons, typed errors, no leaks."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from engine_harness import PROMPTS, assert_no_leak, make_engine, write_tiny_config
from engine import (
    InvalidConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParams,
    UnsupportedModelError,
)

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def test_generate_output_fields(default_engine):
    out = default_engine.generate(
        PROMPT, SamplingParams(temperature=0, max_new_tokens=8, logprobs=True, top_logprobs=3)
    )
    assert out.completion_tokens == len(out.token_ids) <= 8
    assert out.prompt_tokens == len(default_engine.tokenizer.encode(PROMPT))
    assert out.text == default_engine.tokenizer.decode(out.token_ids)
    assert out.finish_reason in ("stop", "length")
    assert len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == tok  # greedy: chosen is the best


def test_generate_queues_its_whole_batch_before_the_next_step():
    """A batch given to generate is one prefill batch however slowly the front end sends it (here 50 ms between
    two messages, time for the loop to step): which requests share a step decides how each one's numbers are
    rounded on a GPU, so greedy outputs of a batch do not depend on timing."""
    engine = make_engine()
    try:
        send = engine.core.send

        def slow_send(msg):
            send(msg)
            time.sleep(0.05)

        engine.core.send = slow_send
        counters = lambda: dict(engine._call(lambda: engine.local_core.scheduler.counters))  # noqa: E731
        before = counters()
        engine.generate(PROMPTS, dict(temperature=0, max_new_tokens=2, ignore_eos=True))
        after = counters()
        assert after["prefill_steps"] - before["prefill_steps"] == 1, (before, after)
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_seed_reproducible_whatever_the_batch(default_engine):
    params = dict(temperature=0.9, top_p=0.95, max_new_tokens=16, seed=1234)
    alone = default_engine.generate(PROMPT, params).token_ids
    crowd = default_engine.generate(
        ["Hello", PROMPT, "1, 2, 3,"], [dict(temperature=1.0, max_new_tokens=16), params, dict(temperature=0.5)]
    )
    assert crowd[1].token_ids == alone
    other = default_engine.generate(PROMPT, {**params, "seed": 4321}).token_ids
    assert other != alone


def test_n_choices_share_the_prompt_kv(default_engine):
    prompt = "A list of ten imaginative names for a pet dragon:" + " Go!" * 20
    outs = default_engine.generate(prompt, dict(n=3, temperature=1.0, max_new_tokens=12, seed=7))
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert all(o.cached_tokens >= o.prompt_tokens - 1 for o in outs[1:]), [o.cached_tokens for o in outs]
    again = default_engine.generate(prompt, dict(n=3, temperature=1.0, max_new_tokens=12, seed=7))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert_no_leak(default_engine)


def test_penalties_and_filters_run(default_engine):
    outs = default_engine.generate(
        [PROMPT] * 4,
        [
            dict(temperature=0.7, top_k=5, max_new_tokens=10, seed=1),
            dict(temperature=1.0, min_p=0.2, max_new_tokens=10, seed=2),
            dict(temperature=0, repetition_penalty=1.3, max_new_tokens=10),
            dict(temperature=0.8, frequency_penalty=1.0, presence_penalty=0.5, max_new_tokens=10, seed=3),
        ],
    )
    assert all(o.completion_tokens == 10 or o.finish_reason == "stop" for o in outs)


def test_finish_reasons(default_engine):
    tok = default_engine.tokenizer
    greedy = default_engine.generate(PROMPT, dict(temperature=0, max_new_tokens=20))
    # stop string: the text ends before it, and the reason is "stop".
    word = greedy.text.split()[2]
    stopped = default_engine.generate(PROMPT, dict(temperature=0, max_new_tokens=20, stop=[word]))
    assert stopped.finish_reason == "stop" and stopped.matched_stop == word
    assert stopped.text == greedy.text[: greedy.text.index(word)]
    # stop token id
    stop_id = greedy.token_ids[3]
    by_id = default_engine.generate(PROMPT, dict(temperature=0, max_new_tokens=20, stop_token_ids=[stop_id]))
    assert by_id.finish_reason == "stop" and by_id.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    # max_new_tokens (0: prefill only, the prompt is cached)
    assert default_engine.generate(PROMPT, dict(temperature=0, max_new_tokens=3)).finish_reason == "length"
    zero = default_engine.generate(PROMPT + " zero", dict(max_new_tokens=0))
    assert zero.finish_reason == "length" and zero.token_ids == [] and zero.text == ""
    # EOS: the chat template makes the model answer and end its turn; ignore_eos runs on.
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    eos = default_engine.generate(chat, dict(temperature=0, max_new_tokens=64))
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in tok.eos_token_ids
    forced = default_engine.generate(chat, dict(temperature=0, max_new_tokens=len(eos.token_ids) + 3, ignore_eos=True))
    assert forced.finish_reason == "length" and forced.token_ids[: len(eos.token_ids)] == eos.token_ids
    assert_no_leak(default_engine)


def test_context_length_finishes_with_length():
    with make_engine(context_length=40) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        out = engine.generate(PROMPT, dict(temperature=0, max_new_tokens=100, ignore_eos=True))
        assert out.finish_reason == "length" and len(ids) + out.completion_tokens == 40
        with pytest.raises(PromptTooLongError):
            engine.generate(list(range(10, 50)), dict(max_new_tokens=1))
        assert_no_leak(engine)


def test_stream_matches_generate(default_engine):
    params = dict(temperature=0, max_new_tokens=24)
    full = default_engine.generate(PROMPT, params)

    async def collect():
        chunks = [c async for c in default_engine.generate_stream(PROMPT, params)]
        return chunks

    chunks = asyncio.run(collect())
    assert "".join(c.text for c in chunks) == full.text
    assert sum((c.new_token_ids for c in chunks), []) == full.token_ids
    assert chunks[-1].finish_reason == full.finish_reason and chunks[-1].completion_tokens == full.completion_tokens


@pytest.mark.parametrize("coalesce", [False, True])
def test_stream_coalesces_what_waits_for_a_slow_consumer(default_engine, coalesce):
    """A consumer that takes the first output, then returns only after the request ended: with `coalesce`
    the outputs that waited come as one (tokens, text, logprobs in order; the last one's finish and
    counts), without it one per step; the concatenation is generate's result either way."""
    params = dict(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=True)
    full = default_engine.generate(PROMPT, params)

    async def slow():
        stream = default_engine.generate_stream(PROMPT, params, coalesce=coalesce)
        first = await stream.__anext__()
        for _ in range(400):  # the core finishes the request meanwhile; its outputs wait in the stream
            stats = await default_engine.stats_async()
            if stats.running == 0 and stats.waiting == 0:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        return [first] + [out async for out in stream]

    chunks = asyncio.run(slow())
    rest = chunks[1:]
    assert len(rest) == 1 if coalesce else len(rest) > 1
    assert sum((c.new_token_ids for c in chunks), []) == full.token_ids
    assert "".join(c.text for c in chunks) == full.text
    assert [lp.token_id for c in chunks for lp in c.logprobs] == full.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 24
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert_no_leak(default_engine)


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n"),
        (dict(top_logprobs=50), "top_logprobs"),
        (dict(bogus=1), "bogus"),
        (dict(n=100000), "n"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**70), "seed"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=10**12), "top_k"),
        (dict(stop_token_ids=[10**12]), "stop_token_ids"),
        (dict(stop=[f"s{i}" for i in range(1000)]), "stop"),
        (dict(stop=["\ud800"]), "stop"),
    ],
)
def test_invalid_sampling_params_are_typed_errors(default_engine, bad, param):
    with pytest.raises(InvalidRequestError) as err:
        default_engine.generate(PROMPT, bad)
    assert err.value.param == param and param in str(err.value)
    assert default_engine.generate("Hi", dict(max_new_tokens=2)).completion_tokens >= 1


def test_invalid_prompts_are_typed_errors(default_engine):
    with pytest.raises(PromptTooLongError, match="context length"):
        default_engine.generate([5] * 9000, dict(max_new_tokens=1))
    with pytest.raises(InvalidRequestError, match="empty"):
        default_engine.generate("", dict(max_new_tokens=1))
    with pytest.raises(InvalidRequestError, match="token ids"):
        default_engine.generate([1, 10**9], dict(max_new_tokens=1))
    with pytest.raises(InvalidRequestError):
        default_engine.generate(PROMPT, [dict(), dict()])
    assert default_engine.generate("Hi", dict(max_new_tokens=2)).completion_tokens >= 1
    assert_no_leak(default_engine)


def test_invalid_engine_arguments(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        make_engine(model=str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        make_engine(model=str(tmp_path))
    with pytest.raises(InvalidConfigError, match="page_size"):
        make_engine(page_size=0)
    with pytest.raises(InvalidConfigError, match="unknown engine option"):
        make_engine(not_an_option=1)


def test_randomized_abort_retract_finish_mix_leaks_nothing(tmp_path):
    """Completed, aborted (waiting and running) and retracted requests: afterwards every page is
    free or evictable cache, nothing locked. Page accounting does not depend on the weights, so a tiny
    Llama with dummy weights and the default model's tokenizer (the same prompt lengths) runs the mix."""
    rng = random.Random(0)
    tiny = write_tiny_config(tmp_path, vocab_size=49152)
    with make_engine(
        model=tiny,
        load_format="dummy",
        tokenizer="SmolLM2-135M-Instruct",
        max_total_tokens=256,  # six running requests outgrow it: some are retracted
        page_size=4,
        max_running_requests=6,
    ) as engine:

        async def one(i):
            params = dict(
                temperature=rng.choice([0, 0.8]),
                max_new_tokens=rng.randint(1, 40),
                seed=i,
                ignore_eos=rng.random() < 0.5,
            )
            prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(3, 60)))
            abort_after = rng.choice([None, None, 0, 1, 3])
            seen = 0
            async for _ in engine.generate_stream(prompt, params, rid=f"r{i}"):
                seen += 1
                if abort_after is not None and seen > abort_after:
                    break  # leaving the iterator aborts the request

        async def main():
            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            await asyncio.sleep(0.05)
            engine.abort("r5")  # abort by id, possibly still waiting
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=900)  # a hang guard, not a speed requirement

        asyncio.run(main())
        stats = engine.stats()
        assert stats.aborted > 0 and stats.finished > 0 and stats.retractions > 0, stats
        # let the loop process the last aborts
        for _ in range(50):
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert_no_leak(engine)
        assert engine.generate("Still alive?", dict(max_new_tokens=3)).completion_tokens >= 1


def test_prompt_logprobs_match_a_full_forward(default_engine):
    """Prompt logprobs (chunked or not, cached prefix or not) equal log_softmax of one full forward."""
    import torch
    from model_harness import GreedyHarness

    ids = default_engine.tokenizer.encode(PROMPT + " and a cat named Tom.")
    default_engine.generate(ids, dict(max_new_tokens=1))  # the prompt is now cached: it must not be reused
    out = default_engine.generate(ids, dict(max_new_tokens=2, prompt_logprobs=2, temperature=0))
    assert len(out.prompt_logprobs) == len(ids) - 1
    harness = GreedyHarness(default_engine.runner.model, max_len=64)
    logits = harness.generate([ids], max_new_tokens=1).prefill_logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for pos, lp in enumerate(out.prompt_logprobs):
        assert lp.token_id == ids[pos + 1]
        assert abs(lp.logprob - float(ref[pos, ids[pos + 1]])) < 1e-4
        assert [t for t, _ in lp.top_logprobs] == ref[pos].topk(2).indices.tolist()
    with make_engine(chunked_prefill_size=5) as chunked:
        again = chunked.generate(ids, dict(max_new_tokens=2, prompt_logprobs=2, temperature=0))
        assert [lp.token_id for lp in again.prompt_logprobs] == [lp.token_id for lp in out.prompt_logprobs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(again.prompt_logprobs, out.prompt_logprobs)) < 1e-4
        assert again.token_ids == out.token_ids
    assert_no_leak(default_engine)
