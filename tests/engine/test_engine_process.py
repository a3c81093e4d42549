"""The EngineCore in a process of its own (EngineConfig.core_process, what servers run): the same outputs as
the core in a thread, the same errors, no leaked page, and a dead core fails every request instead of
hanging it. One core process serves the module; the last test kills it."""

import asyncio
import json
import os
import signal

import pytest

from engine_harness import PROMPTS, assert_no_leak, make_engine
from engine.errors import EngineDeadError, InvalidRequestError
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def process_engine():
    engine = make_engine(core_process=True)
    yield engine
    engine.shutdown()


def _stream(engine, prompt, params, **kw):
    async def run():
        return [out async for out in engine.generate_stream(prompt, params, **kw)]

    return asyncio.run(run())


def test_core_runs_in_another_process(process_engine):
    assert process_engine.info.pid != os.getpid() and process_engine.info.pid == process_engine.core.pid
    with pytest.raises(RuntimeError, match="its own process"):
        process_engine.runner


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0, max_new_tokens=24),
        dict(temperature=0.8, top_p=0.9, seed=7, n=2, max_new_tokens=16, logprobs=True, top_logprobs=2),
    ],
)
def test_outputs_equal_the_core_in_a_thread(process_engine, default_engine, sampling):
    want = default_engine.generate(PROMPTS, sampling)
    got = process_engine.generate(PROMPTS, sampling)
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [
        (o.text, o.token_ids, o.finish_reason) for o in want
    ]
    if sampling.get("logprobs"):
        assert [[lp.token_id for lp in o.logprobs] for o in got] == [o.token_ids for o in got]
    assert_no_leak(process_engine)


def test_stream_with_a_stop_string_equals_the_thread_core(process_engine, default_engine):
    params = dict(temperature=0, max_new_tokens=40, ignore_eos=True)
    full = default_engine.generate(PROMPTS[3], params).text
    stop = full[len(full) // 2 :][:5]
    want = default_engine.generate(PROMPTS[3], dict(params, stop=[stop]))
    outs = _stream(process_engine, PROMPTS[3], dict(params, stop=[stop]))
    assert "".join(o.text for o in outs) == want.text and outs[-1].matched_stop == stop
    assert outs[-1].completion_tokens == want.completion_tokens
    assert_no_leak(process_engine)


def test_a_stream_closed_early_frees_its_pages(process_engine):
    async def run():
        gen = process_engine.generate_stream(PROMPTS[1], dict(temperature=0, max_new_tokens=200, ignore_eos=True))
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        return got

    assert len(asyncio.run(run())) == 3
    assert_no_leak(process_engine)


def test_bad_input_raises_typed_errors(process_engine):
    with pytest.raises(InvalidRequestError, match="token ids"):
        process_engine.generate([10**9], dict(max_new_tokens=2))
    with pytest.raises(InvalidRequestError) as err:  # compiled in the core process, raised here
        _stream(process_engine, "x", SamplingParams(max_new_tokens=4, json_schema='{"type": "nope"}'))
    assert err.value.param == "json_schema"

    async def reuse():
        first = process_engine.generate_stream(PROMPTS[0], dict(max_new_tokens=50, ignore_eos=True), rid="same")
        await first.__anext__()
        try:
            with pytest.raises(InvalidRequestError, match="already in use"):
                await process_engine.generate_stream(PROMPTS[0], dict(max_new_tokens=2), rid="same").__anext__()
        finally:
            await first.aclose()

    asyncio.run(reuse())
    assert_no_leak(process_engine)


def test_structured_output_through_the_core_process(process_engine, default_engine):
    prompt = (
        "<|im_start|>user\nGive me a short JSON object describing a cat, with its name and age.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    params = dict(json_schema='{"type": "object"}', temperature=0, max_new_tokens=150)
    got, want = process_engine.generate(prompt, params), default_engine.generate(prompt, params)
    assert got.finish_reason == "stop" and isinstance(json.loads(got.text), dict)
    assert got.token_ids == want.token_ids


def test_a_core_that_does_not_answer_times_out_a_call_and_says_where_it_stands(process_engine):
    """A stopped (SIGSTOP) core answers no call: stats_async(timeout) raises TimeoutError, and core_state()
    (what a worker's health check logs then) names the live process and the call waiting; once resumed it
    answers again."""
    engine = process_engine
    os.kill(engine.core.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(engine.stats_async(timeout=0.5))
        state = engine.core_state()
        assert f"core process {engine.core.pid}: exit code None" in state and "calls waiting: 1" in state, state
    finally:
        os.kill(engine.core.pid, signal.SIGCONT)
    assert asyncio.run(engine.stats_async(timeout=30)).running == 0
    assert_no_leak(engine)


def test_a_killed_core_fails_every_request(process_engine):
    """Kills the module's core process, so it runs last; the fixture's shutdown then meets a dead core."""
    engine = process_engine

    async def run():
        gen = engine.generate_stream(PROMPTS[0], dict(max_new_tokens=10**4, ignore_eos=True))
        await gen.__anext__()
        os.kill(engine.core.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass

    asyncio.run(asyncio.wait_for(run(), 60))
    with pytest.raises(EngineDeadError):
        engine.generate("more", dict(max_new_tokens=2))
    assert f"core process {engine.core.pid}: exit code -9" in engine.core_state()


def test_a_dead_core_raises_the_same_error_on_every_path():
    """Whether a caller meets the core's death through a pending call, a new call or its own request, it sees
    one type: an EngineDeadError such as TensorParallelError as it is, any other error wrapped in one."""
    import threading

    from engine.core.client import CoreClient
    from engine.errors import TensorParallelError

    class Client(CoreClient):  # the base class's death bookkeeping; no core behind it
        def send(self, msg):
            self.sent.append(msg)

        def wait(self, event: threading.Event, timeout: float) -> bool:
            return event.wait(timeout)

        def shutdown(self):
            pass

    for cause, expected in ((TensorParallelError("rank 1 exited"), TensorParallelError), (OSError("pipe"), None)):
        told = []
        client = Client(on_outputs=lambda outs: None, on_dead=told.append)
        client.sent = []
        pending = client._start_call("stats", ())
        client._mark_dead(cause)
        errors = [pending.exception()]
        with pytest.raises(EngineDeadError) as raised:
            client.raise_if_dead()
        errors.append(raised.value)
        with pytest.raises(EngineDeadError) as raised:
            client._start_call("stats", ())
        errors.append(raised.value)
        assert told == [cause] and len(client.sent) == 1
        for err in errors:
            if expected is not None:
                assert err is cause
            else:
                assert type(err) is EngineDeadError and "OSError('pipe')" in str(err)
