"""A request's life: deadlines (`timeout` and the server's default) and the drain on shutdown
(serving/lifetime.py, serving/server.py). Every ended request frees its KV pages."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster_harness import wait_for
from engine_harness import assert_no_leak
from serving_harness import MODEL, python_m_serving, serve, wait_idle

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def _cmpl(**kw):
    return {"model": MODEL, "prompt": "Once upon a time", **kw}


def _app(engine, **kw):
    from serving.app import build_app
    from serving.backend import EngineBackend

    return build_app(EngineBackend(engine), model_name=MODEL, **kw)


def _events(response: httpx.Response) -> list:
    """The SSE events of a response; the last must be [DONE]."""
    events = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _idle_and_clean(engine):
    stats = wait_idle(engine)
    assert stats.running == 0 and stats.waiting == 0
    assert_no_leak(engine)


def test_timeout_ends_the_request_and_frees_its_pages(default_engine):
    with serve(_app(default_engine)) as url, httpx.Client(base_url=url, timeout=60) as c:
        generated = default_engine.stats().generated_tokens
        r = c.post("/v1/completions", json=_cmpl(timeout=0.5, **LONG))
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "deadline_exceeded" and r.json()["error"]["param"] == "timeout"
        # Ended at its deadline, not after its 3,000 tokens (a count, not a clock: the CPU may be shared).
        assert wait_idle(default_engine).generated_tokens - generated < LONG["max_tokens"]
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "timeout": 5,  # its first token comes well before (else a 504); its 3,000 tokens do not
                **LONG,
            },
        ) as s:
            assert s.status_code == 200
            events = _events(s)
        assert events[-1]["error"]["code"] == "deadline_exceeded"
        assert all("error" not in e for e in events[:-1])
        _idle_and_clean(default_engine)
        for bad in (0, -1, "soon", 10**6):
            r = c.post("/v1/completions", json=_cmpl(timeout=bad, max_tokens=2))
            assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
        assert c.post("/v1/completions", json=_cmpl(timeout=60, max_tokens=2)).status_code == 200


def test_the_server_default_deadline_bounds_every_request(default_engine):
    # 5 s: far below the 3,000 tokens' time on CPU, far above a 2-token request's even on a loaded machine
    with serve(_app(default_engine, request_timeout_s=5.0)) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            "/generate",
            json={"text": "Hi", "timeout": 100, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}},
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        assert c.post("/v1/completions", json=_cmpl(max_tokens=2)).status_code == 200
    _idle_and_clean(default_engine)


def _drain_in_thread(app, grace_s: float):
    """A DrainingServer on a free port in a thread; returns (server, thread, url)."""
    from serving.server import DrainingServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = DrainingServer(app, grace_s, host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def _stream_all(url: str, bodies: list, started: threading.Barrier) -> list:
    def one(body):
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            started.wait()
            rest = [line for line in lines if line]
        events = [first[len("data: ") :]] + [line[len("data: ") :] for line in rest]
        assert events[-1] == "[DONE]", events[-3:]
        return [json.loads(e) for e in events[:-1]]

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def test_drain_lets_running_streams_finish_then_stops(default_engine):
    app = _app(default_engine)
    server, thread, url = _drain_in_thread(app, grace_s=60)
    started = threading.Barrier(5)
    bodies = [_cmpl(stream=True, max_tokens=24, temperature=0, ignore_eos=True) for _ in range(4)]
    with ThreadPoolExecutor(1) as pool:
        results = pool.submit(_stream_all, url, bodies, started)
        started.wait()
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        # uvicorn looks every 0.1 s; a loaded machine may take longer
        wait_for(lambda: app.state.serving.lifetimes.draining, 30, "the server to start draining", 0.05)
        time.sleep(0.3)  # uvicorn closes its listener right after the drain starts, in the same step
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{url}/v1/completions", json=_cmpl(max_tokens=2), timeout=5)
        streams = results.result(timeout=120)
    for events in streams:
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 1
    thread.join(timeout=30)
    assert not thread.is_alive()
    _idle_and_clean(default_engine)


def test_drain_ends_what_outlives_the_grace_period_with_an_error(default_engine):
    app = _app(default_engine)
    server, thread, url = _drain_in_thread(app, grace_s=1.0)
    started = threading.Barrier(3)
    with ThreadPoolExecutor(1) as pool:
        results = pool.submit(_stream_all, url, [_cmpl(stream=True, **LONG) for _ in range(2)], started)
        started.wait()
        server.should_exit = True
        streams = results.result(timeout=60)
    for events in streams:  # cut by the grace period: an error before the 3,000th token
        assert events[-1]["error"]["code"] == "shutting_down" and len(events) < LONG["max_tokens"]
    thread.join(timeout=30)
    assert not thread.is_alive()
    _idle_and_clean(default_engine)


def test_lifetimes_refuse_while_draining():
    import asyncio

    from serving.errors import APIError
    from serving.lifetime import Lifetimes

    async def scenario():
        lifetimes = Lifetimes(default_timeout_s=100)
        life = lifetimes.begin(5)
        assert lifetimes.active == 1
        lifetimes.drain(0.05)
        with pytest.raises(APIError) as refused:
            lifetimes.begin(None)
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        with pytest.raises(APIError) as cut:
            await life.bounded(asyncio.sleep(10))
        assert cut.value.code == "shutting_down"
        life.end()
        await asyncio.wait_for(lifetimes.idle(), 1)

    asyncio.run(scenario())


def test_sigterm_drains_python_m_serving_and_frees_the_port(tmp_path):
    """The acceptance run: 8 streams, SIGTERM, a 30 s grace; all 8 end with their last token and
    [DONE]; the process exits and its port is free."""
    args = ("--served-model-name", MODEL, "--graceful-shutdown-timeout-s", "30", "--log-level", "warning")
    with python_m_serving(*args, log_path=str(tmp_path / "server.log")) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        started = threading.Barrier(9)
        bodies = [_cmpl(stream=True, max_tokens=48, temperature=0, ignore_eos=True) for _ in range(8)]
        with ThreadPoolExecutor(1) as pool:
            results = pool.submit(_stream_all, url, bodies, started)
            started.wait()
            proc.send_signal(signal.SIGTERM)
            streams = results.result(timeout=120)
        for events in streams:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
        with socket.socket() as s:  # free again: a new server (SO_REUSEADDR, as uvicorn binds) can listen
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def test_idle_keep_alive_connection_outlives_the_clients_expiry(tmp_path):
    """httpx and the openai SDK drop a pooled connection after 5 idle seconds. The server keeps it open
    longer (`--keep-alive-timeout-s`), so a client that reuses one after 6 s is answered on it, instead of
    racing the server's close (a connection reset before the request reaches the app)."""
    import http.client

    with python_m_serving("--log-level", "warning", log_path=str(tmp_path / "server.log")) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", "/health")
            first = conn.getresponse()
            first.read()
            sock = conn.sock
            time.sleep(6)
            conn.request("GET", "/health")
            second = conn.getresponse()
            second.read()
            assert (first.status, second.status) == (200, 200)
            assert conn.sock is sock  # the same connection, not a new one
        finally:
            conn.close()
