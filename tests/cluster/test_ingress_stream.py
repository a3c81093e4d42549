"""The ingress's reading of one request's worker stream (ClusterBackend._outputs): what already waits in the
request's queue when the ingress gets to it is handed on as one output per choice, with the same tokens,
text, logprobs and finish as one output per engine step; an error behind outputs comes after them.

The queue is filled by hand with what a worker streams (WorkerItem of a StreamOutput without text); the real
worker stream is covered by tests/cluster/test_cluster.py."""

import asyncio

import pytest

pytest.importorskip("ray")

from cluster.ingress.backend import ClusterBackend, Continuation, RequestProgress  # noqa: E402
from cluster.ingress.latency import RequestClock  # noqa: E402
from cluster.workers.base import WorkerItem  # noqa: E402
from engine.outputs import StreamOutput, TokenLogprob  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.text import OutputText  # noqa: E402

PROMPT = "Write one sentence about the sea."
ANSWER = " The sea is wide, and its waves — grey, green, silver — never rest."


@pytest.fixture(scope="module")
def tokenizer():
    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


def _steps(rid: str, ids, prompt_len: int, index: int = 0):
    """One StreamOutput per token, as a worker sends them step by step; the last one finishes (length)."""
    return [
        StreamOutput(
            rid,
            index,
            [t],
            "",
            [TokenLogprob(t, -0.5 - k)],
            "length" if k == len(ids) - 1 else None,
            None,
            prompt_len,
            0,
            k + 1,
        )
        for k, t in enumerate(ids)
    ]


def _read(tokenizer, prompt_ids, params, items, read_each: bool):
    """What _outputs yields for `items`: queued one at a time as it reads (read_each), or all before it reads."""
    backend = ClusterBackend(None, None, tokenizer, context_len=2048, vocab_size=tokenizer.vocab_size)
    text = OutputText(tokenizer, prompt_ids, params)

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        progress = RequestProgress(params.n)
        clock = RequestClock()
        gen = backend._outputs(queue, text, "w", "r", params.n, clock, progress, Continuation(prompt_ids, params))
        got, error = [], None
        try:
            if read_each:
                for item in items:
                    queue.put_nowait(item)
                    got.append(await gen.__anext__())
                await gen.aclose()
            else:
                for item in items:
                    queue.put_nowait(item)
                async for out in gen:
                    got.append(out)
        except RuntimeError as exc:
            error = exc
        return got, error, clock, progress

    return asyncio.run(run())


def test_outputs_that_wait_come_as_one_with_the_same_tokens_text_and_finish(tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids), logprobs=True)
    items = [WorkerItem("r", out) for out in _steps("r", ids, len(prompt_ids))]

    each, _, _, _ = _read(tokenizer, prompt_ids, params, items, read_each=True)
    late, _, clock, progress = _read(tokenizer, prompt_ids, params, items, read_each=False)

    assert len(each) == len(ids) and len(late) == 1
    for outs in (each, late):
        assert sum((o.new_token_ids for o in outs), []) == ids
        assert "".join(o.text for o in outs) == tokenizer.decode(ids)
        assert [lp.token_id for o in outs for lp in o.logprobs] == ids
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == len(ids)
    assert progress.running == 0
    assert clock.messages == len(ids) and clock.tokens == len(ids)  # every worker message still counted


def test_choices_are_not_merged_with_each_other(tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)[:6]
    params = SamplingParams(max_new_tokens=3, n=2)
    first, second = _steps("r", ids[:3], len(prompt_ids), 0), _steps("r", ids[3:], len(prompt_ids), 1)
    interleaved = [WorkerItem("r", o) for pair in zip(first, second) for o in pair]
    in_order = [WorkerItem("r", o) for o in first + second]

    mixed, _, _, _ = _read(tokenizer, prompt_ids, params, interleaved, read_each=False)
    runs, _, _, _ = _read(tokenizer, prompt_ids, params, in_order, read_each=False)

    assert len(mixed) == 6  # no two outputs in a row are of one choice
    assert [(o.index, o.new_token_ids) for o in runs] == [(0, ids[:3]), (1, ids[3:])]
    for outs in (mixed, runs):
        for i, part in ((0, ids[:3]), (1, ids[3:])):
            mine = [o for o in outs if o.index == i]
            assert sum((o.new_token_ids for o in mine), []) == part and mine[-1].finish_reason == "length"


def test_an_error_behind_outputs_is_raised_after_them(tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)[:5]
    params = SamplingParams(max_new_tokens=10)
    steps = [WorkerItem("r", o) for o in _steps("r", ids, len(prompt_ids))[:4]]  # no finish yet
    items = steps + [WorkerItem("r", error=RuntimeError("worker failed"))]

    got, error, _, progress = _read(tokenizer, prompt_ids, params, items, read_each=False)

    assert [o.new_token_ids for o in got] == [ids[:4]]
    assert str(error) == "worker failed" and progress.failed
