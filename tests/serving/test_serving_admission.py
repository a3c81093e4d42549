"""AdmissionGate (serving/admission.py): a backend's admission limit refuses the requests beyond it before their
body is read, 503 queue_full + Retry-After; other routes still answer; the gate's count falls back as requests end.
Runs the real app over the real engine; only the limit is set here (the cluster's backend takes it from its
router)."""

from __future__ import annotations

import threading
import time

import httpx

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

TIMEOUT_S = 60.0  # a guard against a hang, not a speed requirement


def _gated_app(engine, limit: int):
    from serving.app import build_app
    from serving.backend import EngineBackend

    class LimitedBackend(EngineBackend):
        def admission_limit(self):
            return limit

    return build_app(LimitedBackend(engine), model_name=MODEL)


def _long_stream(url: str, started: threading.Event, stop: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return  # closing the stream aborts the request


def test_requests_beyond_the_limit_are_refused_before_their_body_is_read(default_engine):
    with serve(_gated_app(default_engine, 2)) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as c:
        stop = threading.Event()
        started = [threading.Event() for _ in range(2)]
        threads = [threading.Thread(target=_long_stream, args=(url, s, stop)) for s in started]
        for t in threads:
            t.start()
        try:
            for s in started:
                assert s.wait(TIMEOUT_S)
            # Not JSON at all: a 400 had the body been parsed; the gate answers first.
            r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            for path in ("/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages"):
                assert c.post(path, json={}).status_code == 503, path
            assert c.get("/v1/models").status_code == 200  # not a generation route
            assert c.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).status_code == 200
        finally:
            stop.set()
            for t in threads:
                t.join(TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:  # the gate's count falls as the two streams' responses end
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
            if r.status_code != 503:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    wait_idle(default_engine)
    assert_no_leak(default_engine)


def test_a_burst_is_answered_before_its_requests_start():
    """30 requests entering at once against a limit of 20: START_BATCH start at once, the 10 beyond the limit are
    refused before any other admitted request starts its work; those start, in order, in the next turns of the
    loop; a lone request later starts at once."""
    import asyncio

    from serving import admission

    first_held = admission.START_BATCH

    class Limited:
        def admission_limit(self):
            return 20

    log = []

    async def app(scope, receive, send):
        log.append(("start", scope["i"]))
        await asyncio.sleep(0)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = admission.AdmissionGate(app, Limited())

    async def one(i: int) -> int:
        status = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if message["status"] == 503:
                    log.append(("refused", i))

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "i": i}
        await gate(scope, receive, send)
        return status[0]

    async def run():
        statuses = await asyncio.gather(*(one(i) for i in range(30)))
        assert gate.held == 0
        lone = asyncio.ensure_future(one(99))
        await asyncio.sleep(0)
        assert ("start", 99) in log  # it started in its first step: not held
        assert await lone == 200
        return statuses

    statuses = asyncio.run(run())
    assert statuses == [200] * 20 + [503] * 10
    order = {entry: k for k, entry in enumerate(log)}
    last_refusal = max(order[("refused", i)] for i in range(20, 30))
    assert all(order[("start", i)] < last_refusal for i in range(first_held))  # not held: they start at once
    held_starts = [order[("start", i)] for i in range(first_held, 20)]
    assert min(held_starts) > last_refusal and held_starts == sorted(held_starts)
