"""The README's run command stopped as a user stops it: `bash deploy/serve.sh`, 8 streams running, SIGTERM.

serve.sh drains first (cluster.shutdown: the ingress stops admitting, running requests get the grace
period, default 30 s), then stops `serve run`, which shuts Serve, HAProxy and Ray down. Checked: every
stream ends with its last token and [DONE], the script exits, and port 8000 is free again.

Also checked while it runs: HAProxy's stats page and Prometheus exporter listen on 127.0.0.1 only
(cluster/ingress/haproxy_launcher.py) and answer there, while the endpoint answers on port 8000.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from cluster_harness import SERVE_SH_URL, serve_sh, wait_for

pytest.importorskip("ray")
MODEL = "SmolLM2-135M-Instruct"
STREAMS = 8


def _stream(body: dict, started: threading.Barrier) -> list:
    """The SSE events of one streamed completion (the last must be [DONE]), after the first arrived and every
    other stream's too (`started`)."""
    with httpx.Client(base_url=SERVE_SH_URL, timeout=180) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        started.wait(timeout=120)
        rest = [line for line in lines if line]
    events = [first[len("data: ") :]] + [line[len("data: ") :] for line in rest]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _listening(port: int) -> set:
    """The addresses a TCP socket listens on at `port`, on this machine."""
    return {c.laddr.ip for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port}


def _assert_haproxy_admin_ports_on_localhost() -> None:
    """HAProxy's stats page and exporter (Ray's default ports, 8404 and 9101: serve_sh starts serve.sh without
    this process's RAY_SERVE_* settings) listen on 127.0.0.1 only and answer there; the endpoint answers on
    port 8000."""
    stats, metrics = 8404, 9101
    for port in (stats, metrics):
        assert wait_for(lambda: _listening(port), 30, f"HAProxy listening on port {port}") == {"127.0.0.1"}
    assert httpx.get(f"http://127.0.0.1:{stats}/stats", timeout=30).status_code == 200
    assert "haproxy_process" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=30).text
    assert httpx.get(f"{SERVE_SH_URL}/v1/models", timeout=30).status_code == 200


def test_sigterm_drains_running_streams_then_stops_and_frees_the_port(tmp_path):
    body = dict(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0, ignore_eos=True, stream=True)
    with serve_sh(log_path=str(tmp_path / "serve.log")) as proc:
        _assert_haproxy_admin_ports_on_localhost()
        started = threading.Barrier(STREAMS + 1)
        with ThreadPoolExecutor(STREAMS) as pool:
            streams = [pool.submit(_stream, body, started) for _ in range(STREAMS)]
            started.wait(timeout=180)
            proc.send_signal(signal.SIGTERM)
            ends = [s.result(timeout=180)[-1]["choices"][0]["finish_reason"] for s in streams]
        assert ends == ["length"] * STREAMS
        assert proc.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    log = (tmp_path / "serve.log").read_text()
    assert "radixserve: drained 1 ingress replica(s)" in log, log[-3000:]
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 8000))
