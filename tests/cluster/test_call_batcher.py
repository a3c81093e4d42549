"""CallBatcher: at most one call of a kind in flight per ingress replica; the items that arrive meanwhile go
together in the next call, and each caller gets its own item's answer (a routing decision, or its routing
error), whoever else shares the call. The router's side (Router.route_many, finish_many) runs in
tests/cluster/test_cluster.py."""

import asyncio

import pytest

from serving.call_batcher import CallBatcher
from cluster.router.policies import PoolFullError, RouteRequest


class FakeRouter:
    """route_many: answers prompt [i] with f"w{i}", refuses prompts listed in `full`; each call waits for
    `release` when one is given, so that a test decides when it returns."""

    def __init__(self, full=(), fail_calls=()):
        self.batches, self.full, self.fail_calls = [], set(full), set(fail_calls)
        self.release = None

    async def route_many(self, requests):
        self.batches.append([r.rid for r in requests])
        if self.release is not None:
            await self.release.wait()
            self.release.clear()
        if len(self.batches) in self.fail_calls:
            raise ConnectionError("router unreachable")
        return [PoolFullError("full") if r.rid in self.full else f"w{r.input_ids[0]}" for r in requests]


def _request(i):
    return RouteRequest([i, 1, 2], rid=f"r{i}")


def test_a_burst_goes_in_two_calls_and_each_caller_gets_its_own_answer():
    async def run():
        router = FakeRouter(full={"r3"})
        router.release = asyncio.Event()
        batcher = CallBatcher("routing", router.route_many)
        first = batcher.submit(_request(0))
        await asyncio.sleep(0)  # the first call is in flight ...
        rest = [batcher.submit(_request(i)) for i in range(1, 6)]  # ... when a burst arrives
        for _ in range(2):
            router.release.set()
            await asyncio.sleep(0.01)
        assert router.batches == [["r0"], ["r1", "r2", "r3", "r4", "r5"]]
        assert await first == "w0"
        assert [await f for f in rest if f is not rest[2]] == ["w1", "w2", "w4", "w5"]
        with pytest.raises(PoolFullError):
            await rest[2]
        assert (batcher.calls, batcher.items) == (2, 6)

    asyncio.run(run())


def test_a_lone_prompt_is_sent_at_once():
    async def run():
        router = FakeRouter()
        batcher = CallBatcher("routing", router.route_many)
        assert await batcher.submit(_request(7)) == "w7"
        assert await batcher.submit(_request(8)) == "w8"
        assert router.batches == [["r7"], ["r8"]]

    asyncio.run(run())


def test_a_failed_call_fails_its_prompts_only():
    async def run():
        router = FakeRouter(fail_calls={1})
        router.release = asyncio.Event()
        batcher = CallBatcher("routing", router.route_many)
        first = batcher.submit(_request(0))
        await asyncio.sleep(0)
        second = batcher.submit(_request(1))
        for _ in range(2):
            router.release.set()
            await asyncio.sleep(0.01)
        with pytest.raises(ConnectionError):
            await first
        assert await second == "w1"

    asyncio.run(run())


def test_batches_are_capped():
    async def run():
        router = FakeRouter()
        router.release = asyncio.Event()
        batcher = CallBatcher("routing", router.route_many, max_batch=2)
        futures = [batcher.submit(_request(i)) for i in range(5)]
        for _ in range(3):
            router.release.set()
            await asyncio.sleep(0.01)
        assert [await f for f in futures] == [f"w{i}" for i in range(5)]
        assert router.batches == [["r0", "r1"], ["r2", "r3"], ["r4"]]

    asyncio.run(run())


def test_stopping_cancels_the_waiting_prompts():
    async def run():
        router = FakeRouter()
        router.release = asyncio.Event()
        batcher = CallBatcher("routing", router.route_many)
        futures = [batcher.submit(_request(i)) for i in range(3)]
        await asyncio.sleep(0)
        batcher._task.cancel()  # the replica's loop is shutting down
        await asyncio.sleep(0)
        assert all(f.cancelled() for f in futures)
        assert batcher._task is None
        router.release.set()
        assert await batcher.submit(_request(9)) == "w9"  # a later prompt starts a call of its own

    asyncio.run(run())


def test_calls_nobody_awaits_go_in_batches_and_their_failures_are_logged(caplog):
    async def run():
        sent = []
        gate = asyncio.Event()

        async def finish_many(items):
            sent.append(list(items))
            await gate.wait()
            gate.clear()
            if len(sent) == 2:
                raise ConnectionError("router unreachable")
            return [None] * len(items)

        batcher = CallBatcher("finish", finish_many)
        batcher.submit_nowait("a")
        await asyncio.sleep(0)
        for item in "bcd":
            batcher.submit_nowait(item)
        for _ in range(2):
            gate.set()
            await asyncio.sleep(0.01)
        assert sent == [["a"], ["b", "c", "d"]] and batcher._task is None

    with caplog.at_level("WARNING", logger="serving.call_batcher"):
        asyncio.run(run())
    assert sum("router unreachable" in r.getMessage() for r in caplog.records) == 3
