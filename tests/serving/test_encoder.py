"""serving/encoder.py: prompts encoded off the event loop, in batches, to the ids Tokenizer.encode gives."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import InvalidRequestError
from engine.models.source import resolve_model
from engine.tokenizer import load_tokenizer
from serving.encoder import BatchEncoder, default_threads, split_even

TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing ",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — 東京 🚀 " * 20,
    "\n\n\t tabs\tand\nnewlines ",
    " ".join(f"word{i}" for i in range(3000)),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def test_a_burst_is_encoded_in_few_batches_to_the_same_ids(tokenizer):
    encoder = BatchEncoder(tokenizer, threads=2)

    async def burst():
        jobs = [encoder.encode(t, special) for t in TEXTS * 3 for special in (True, False)]
        return await asyncio.gather(*jobs)

    got = asyncio.run(burst())
    want = [tokenizer.encode(t, special) for t in TEXTS * 3 for special in (True, False)]
    assert got == want
    assert encoder.texts == len(want)
    assert encoder.batches <= 4  # the first text alone, then both kinds of what came meanwhile
    encoder.close()


def test_bad_text_fails_alone_and_at_once(tokenizer):
    encoder = BatchEncoder(tokenizer, threads=1)

    async def burst():
        good = asyncio.gather(encoder.encode("fine"), encoder.encode("also fine", False))
        with pytest.raises(InvalidRequestError) as surrogate:
            await encoder.encode("a\ud800b", param="messages")
        with pytest.raises(InvalidRequestError) as not_text:
            await encoder.encode(7)  # type: ignore[arg-type]
        return await good, surrogate.value, not_text.value

    (one, two), surrogate, not_text = asyncio.run(burst())
    assert one == tokenizer.encode("fine") and two == tokenizer.encode("also fine", False)
    assert surrogate.param == "messages" and "U+D800" in str(surrogate)
    assert not_text.param == "prompt"


def test_a_waiter_that_gives_up_leaves_the_others_their_ids(tokenizer):
    encoder = BatchEncoder(tokenizer, threads=1)

    async def run():
        first = asyncio.ensure_future(encoder.encode("first"))
        given_up = asyncio.ensure_future(encoder.encode("given up"))
        last = asyncio.ensure_future(encoder.encode("last"))
        await asyncio.sleep(0)
        given_up.cancel()
        return await first, await last, given_up.cancelled()

    first, last, cancelled = asyncio.run(run())
    assert (first, last, cancelled) == (tokenizer.encode("first"), tokenizer.encode("last"), True)
    assert all(b._task is None and not b._pending for b in encoder._batchers.values())


def test_the_event_loop_runs_while_a_batch_is_encoded(tokenizer):
    """The tokenizer works on a worker thread: other coroutines (streams) keep running meanwhile."""
    encoder = BatchEncoder(tokenizer, threads=1)
    big = [" ".join(f"token{i}" for i in range(20000))] * 8

    async def run():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = ticks
        ids = await asyncio.gather(*(encoder.encode(t) for t in big))
        during = ticks - before
        done.set()
        await task
        return ids, during

    ids, during = asyncio.run(run())
    assert ids == [tokenizer.encode(big[0])] * len(big)
    assert during > 1  # inline encoding would have given the ticker no turn before the ids came back


def test_split_even_cuts_into_balanced_consecutive_runs():
    texts = ["a" * n for n in (10, 10, 10, 10, 40, 1, 1, 1)]
    for parts in (1, 2, 3, 4, 8, 20):
        runs = split_even(texts, parts)
        assert runs[0][0] == 0 and runs[-1][1] == len(texts)
        assert all(a < b for a, b in runs) and all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
        assert len(runs) <= min(parts, len(texts))
    assert split_even(texts, 2) == [(0, 4), (4, 8)]  # 40 and 43 characters
    assert split_even([""] * 4, 2) == [(0, 2), (2, 4)]
    assert split_even(["x"] * 3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_even(["x"], 4) == [(0, 1)]


def test_default_threads_leave_a_small_machine_one():
    assert [default_threads(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert default_threads() >= 1
