"""The ingress's routing call: the router counts a request in flight as soon as it decides, so a caller
that gives up before the decision arrives (client disconnect, timeout) must still finish it there.

Stand-ins replace the Serve handles (they record calls; `route` answers when the test says so): the
real router and workers are covered by tests/cluster/test_cluster.py."""

import asyncio
from dataclasses import dataclass

import pytest

pytest.importorskip("ray")

from cluster.ingress import backend as ingress  # noqa: E402
from cluster.ingress.backend import ClusterBackend  # noqa: E402
from cluster.router.policies import NoWorkersError  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from serving.errors import APIError  # noqa: E402


@dataclass
class Decision:
    worker_id: str


class Method:
    """One deployment method: `.remote(...)` records the call and returns an awaitable answer."""

    def __init__(self, answer=None):
        self.calls, self.answer = [], answer

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.answer(*args, **kwargs) if callable(self.answer) else _value(self.answer)


async def _value(value):
    return value


class Router:
    """Router.route_many answers each prompt with `route_answer()`, or the routing error it raises;
    finish_many records the workers it is told of in `finished`."""

    def __init__(self, route_answer):
        self.finished = []
        self.route_many = Method(lambda requests: _each(route_answer, requests))
        self.finish_many = Method(self._finish_many)

    async def _finish_many(self, items):
        self.finished += [item.worker_id for item in items]
        return [None] * len(items)


async def _each(route_answer, requests):
    out = []
    for _ in requests:
        try:
            out.append(await route_answer())
        except NoWorkersError as exc:
            out.append(exc)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


def _backend(router, tokenizer) -> ClusterBackend:
    return ClusterBackend(router, workers=None, tokenizer=tokenizer, context_len=2048, vocab_size=100)


async def _drain(gen):
    return [out async for out in gen]


def _slow_router(worker_id: str):
    """A router whose decision (for `worker_id`) comes once the returned event is set."""
    decided = asyncio.Event()

    async def slow_route():
        await decided.wait()
        return Decision(worker_id)

    return Router(slow_route), decided


async def _finished_after(router, decided) -> list:
    """Let the late decision arrive; the workers the router was told were finished."""
    decided.set()
    for _ in range(10):
        await asyncio.sleep(0)
    return list(router.finished)


def test_decision_that_arrives_after_a_disconnect_is_finished(tokenizer):
    async def run():
        router, decided = _slow_router("w1")
        backend = _backend(router, tokenizer)
        task = asyncio.ensure_future(_drain(backend.generate_stream([1, 2, 3], SamplingParams(), "r1")))
        await asyncio.sleep(0.01)
        task.cancel()  # the client left while the router was deciding
        with pytest.raises(asyncio.CancelledError):
            await task
        assert router.finished == []
        # ... and the router decided anyway: it counts r1 in flight on w1 until told
        assert await _finished_after(router, decided) == ["w1"]

    asyncio.run(run())


def test_routing_timeout_finishes_the_late_decision(monkeypatch, tokenizer):
    monkeypatch.setattr(ingress, "_RPC_TIMEOUT_S", 0.01)

    async def run():
        router, decided = _slow_router("w2")
        with pytest.raises(asyncio.TimeoutError):
            await _drain(_backend(router, tokenizer).generate_stream([1], SamplingParams(), "r2"))
        assert await _finished_after(router, decided) == ["w2"]

    asyncio.run(run())


def test_no_workers_is_a_503_and_finishes_nothing(tokenizer):
    async def run():
        async def refuse():
            raise NoWorkersError("pool is empty")

        router = Router(refuse)
        with pytest.raises(APIError) as err:
            await _drain(_backend(router, tokenizer).generate_stream([1], SamplingParams(), "r3"))
        assert err.value.status == 503 and err.value.code == "no_workers"
        assert err.value.headers == {"Retry-After": "1"}
        await asyncio.sleep(0)
        assert router.finished == []

    asyncio.run(run())
