"""The worker → ingress data path in batches (cluster.workers.base.OutputChannel, cluster.ingress.backend.WorkerStream):
one message per engine step carries every request's news, never one message per request; the ingress
side hands each item to its request's queue and fails them all when the stream breaks. Without Ray:
a real engine feeds the channel; a stand-in generator plays the Serve stream."""

import asyncio

import pytest

pytest.importorskip("ray")

from cluster.ingress.backend import WorkerStream  # noqa: E402
from cluster.workers.base import OutputChannel, WorkerItem  # noqa: E402
from engine_harness import PROMPTS  # noqa: E402


def test_one_batch_per_engine_step_for_all_requests(default_engine):
    async def run():
        channel, done = OutputChannel(), set()
        n = 4

        def deliver_to(rid):
            def deliver(item):
                if item.finish_reason is not None:
                    done.add(rid)
                channel.put(WorkerItem(rid, output=item))

            return deliver

        for i in range(n):
            default_engine.submit(
                PROMPTS[i], dict(temperature=0, max_new_tokens=12, ignore_eos=True), deliver_to(f"c{i}"), rid=f"c{i}"
            )
        batches = []
        while len(done) < n:
            batches.append(await asyncio.wait_for(channel.take(), 60))
        return batches

    batches = asyncio.run(run())
    tokens = sum(len(item.output.new_token_ids) for batch in batches for item in batch)
    assert tokens == 4 * 12
    # A batch is one engine step (or several, when the reader lags) for all four requests: about one
    # message per step, far fewer than one per token (48) or per request and step.
    assert any({item.rid for item in batch} == {"c0", "c1", "c2", "c3"} for batch in batches)
    assert len(batches) <= 12 + 2


class _StandInCall:
    """Plays a Serve streaming call: yields the given batches, then raises `error` (if any)."""

    def __init__(self, batches, error=None):
        self.batches, self.error, self.cancelled = batches, error, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for batch in self.batches:
            await asyncio.sleep(0)
            yield batch
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class _StandInWorkers:
    def __init__(self, call):
        self.call = call

    def options(self, **_):
        return self

    @property
    def outputs(self):
        return self

    def remote(self, *args):
        return self.call


def test_worker_stream_routes_items_and_fails_all_on_a_break():
    async def run():
        items = [
            [WorkerItem("a", output="a0"), WorkerItem("b", output="b0")],
            [WorkerItem("a", output="a1"), WorkerItem("x", output="x0")],
        ]
        ended = []
        stream = WorkerStream(
            _StandInWorkers(_StandInCall(items, RuntimeError("worker died"))), "w1", "i1", ended.append
        )
        qa, qb = stream.open("a"), stream.open("b")
        got_a = [await qa.get() for _ in range(3)]
        got_b = [await qb.get() for _ in range(2)]
        late = stream.open("c")  # opened after the break: fails at once
        return got_a, got_b, await late.get(), ended, stream

    got_a, got_b, late, ended, stream = asyncio.run(run())
    assert [i.output for i in got_a[:2]] == ["a0", "a1"] and isinstance(got_a[2].error, RuntimeError)
    assert got_b[0].output == "b0" and isinstance(got_b[1].error, RuntimeError)  # "x" had no queue: dropped
    assert isinstance(late.error, RuntimeError) and ended == [stream]


class _RecordingEngine:
    """Stands in for engine.Engine: records what the worker asks of it."""

    def __init__(self):
        self.submitted, self.aborted = [], []

    def submit(self, input_ids, params, on_output, rid=None):
        self.submitted.append(rid)
        return rid

    def abort(self, rid):
        self.aborted.append(rid)

    def shutdown(self):
        pass


def _bare_worker(replica_id: str):
    """A Worker without Ray: its replica id and a recording engine."""
    import collections

    from cluster.workers.unified import Worker

    worker = Worker.__new__(Worker)
    worker.replica_id, worker.engine = replica_id, _RecordingEngine()
    worker._channels, worker._early_aborts = {}, collections.OrderedDict()
    worker._served, worker._first_output_s, worker._first_output_requests = collections.deque(), 0.0, 0
    return worker


def test_aborts_race_submits_and_stray_aborts_are_ignored():
    """An abort can overtake its request's submit (two calls): the submit is then refused. An abort meant for
    a replica that left reaches another one: it is ignored there, so a request retried there still runs."""
    from engine.sampling_params import SamplingParams

    worker = _bare_worker("me")

    async def run():
        worker.abort("stray", "gone")  # pinned to a dead replica, delivered here
        await worker.submit([1, 2], SamplingParams(), "stray", "ingress", "me")  # the retry lands here
        worker.abort("early", "me")  # overtook its submit
        await worker.submit([1, 2], SamplingParams(), "early", "ingress", "me")
        await worker.submit([1, 2], SamplingParams(), "early", "ingress", "me")  # a tombstone is used once

    asyncio.run(run())
    assert worker.engine.submitted == ["stray", "early"]
    assert worker.engine.aborted == ["early"]
