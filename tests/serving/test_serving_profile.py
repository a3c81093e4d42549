"""POST /start_profile and /stop_profile (serving/profile_routes.py): opt-in torch profiler traces."""

from __future__ import annotations

import gzip
import json
import os
import time

import httpx
import pytest

from engine_harness import assert_no_leak, make_engine
from serving_harness import MODEL, serve


def _app(engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    return build_app(EngineBackend(engine), model_name=MODEL)


def test_profiling_is_refused_with_a_clear_error_when_the_server_did_not_opt_in(http):
    for path in ("/start_profile", "/stop_profile"):
        r = http.post(path)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "profiling_unavailable" and "--profile-dir" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    engine = make_engine(profile_dir=str(folder))
    try:
        with serve(_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as c:
            yield c
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def _complete(c):
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt="The capital of France is", max_tokens=8))
    assert r.status_code == 200


def test_a_trace_of_some_steps_then_one_until_stopped(profiled):
    c = profiled
    r = c.post("/start_profile", json={"num_steps": 2})
    assert r.status_code == 200
    path = r.json()["trace"]
    _complete(c)
    deadline = time.time() + 30  # the profile stops itself after 2 steps and writes the trace in the loop
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)
    with gzip.open(path, "rt") as f:
        assert "launch" in {e.get("name") for e in json.load(f)["traceEvents"]}
    r = c.post("/stop_profile")
    assert r.status_code == 400 and "no profile is recording" in r.json()["error"]["message"]
    assert c.post("/start_profile", json={"num_steps": 0}).status_code in (400, 422)
    r = c.post("/start_profile")  # no body: until stopped
    assert r.status_code == 200
    _complete(c)
    stopped = c.post("/stop_profile")
    assert stopped.status_code == 200 and stopped.json()["trace"] == r.json()["trace"]
    assert os.path.exists(stopped.json()["trace"])
