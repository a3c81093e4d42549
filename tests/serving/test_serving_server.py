"""`python -m serving` as a user starts it: the HTTP process plus its engine core process (the server's
default). A streamed completion gives the engine's greedy text, one chunk per step that produced a token,
KV usage is back to 0 afterwards, and Ctrl-C stops both processes, without a traceback."""

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from engine_harness import PROMPTS
from serving_harness import python_m_serving

pytestmark = pytest.mark.slow


def _children(pid: int) -> list:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serving") / "server.log")
    with python_m_serving("--max-total-tokens", "8192", "--served-model-name", "m", log_path=log) as (proc, url):
        proc.log_path = log
        yield proc, url


def test_streamed_completion_equals_the_engine(server, default_engine):
    _, url = server
    want = default_engine.generate(PROMPTS[2], dict(temperature=0, max_new_tokens=24, ignore_eos=True))
    chunks = []
    body = dict(model="m", prompt=PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == want.text
    # One chunk per engine step with new tokens (overlap and coalescing may merge steps, never split them).
    assert 1 < len(chunks) <= 24 and chunks[-1]["finish_reason"] == "length"
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    usage = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("radixserve_kv_cache_usage")]
    assert usage and usage[0] == 0.0


def test_bad_request_is_a_400(server):
    _, url = server
    r = httpx.post(f"{url}/v1/completions", json=dict(model="m", prompt=[10**9], max_tokens=2), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_the_log_names_the_http_loop_and_parser(server):
    """The project installs uvicorn[standard]: uvicorn runs on uvloop and httptools, and says so."""
    from serving.server import http_stack

    proc, _ = server
    assert http_stack() == {"loop": "uvloop", "parser": "httptools"}
    assert "HTTP: uvicorn on uvloop, httptools parser" in open(proc.log_path).read()


def test_a_pure_python_fallback_is_a_warning(monkeypatch, caplog):
    import importlib.util

    from serving import server as server_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "httptools" else real(name, *a))
    with caplog.at_level("INFO", logger="serving.server"):
        assert server_module.log_http_stack() == {"loop": "uvloop", "parser": "h11"}
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "h11 parser" in record.getMessage()


def test_ctrl_c_stops_the_server_and_its_core(server):
    proc, _ = server
    core = _children(proc.pid)
    assert core, "the engine core process is missing"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == -signal.SIGINT  # ends as the signal asks
    log = open(proc.log_path).read()
    assert "Traceback" not in log, log[-3000:]  # a clean stop, as a user at a terminal sees it
    deadline = time.time() + 30
    while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z" for pid in core):
        assert time.time() < deadline, f"engine core {core} outlived its server"
        time.sleep(0.5)
