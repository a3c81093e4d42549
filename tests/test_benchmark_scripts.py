"""The benchmark scripts run end to end on tiny workloads (they measure nothing here: no timing
is asserted, only that they complete every request and write their JSON)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import assert_no_leak
from serving_harness import MODEL, serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *args):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", name), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("name", ["bench_offline.py", "bench_serving.py", "bench_overhead.py", "bench_router.py",
                                  "bench_kv_transfer.py", "bench_decode.py", "bench_cluster.py",
                                  "bench_overlap.py", "bench_gemv.py", "bench_frontend.py"])
def test_help(name):
    proc = run_script(name, "--help")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dataset", ["shared-prefix", "multi-turn"])
def test_bench_serving_against_the_server(default_engine, tmp_path, dataset):
    from serving.app import build_app
    from serving.backend import EngineBackend

    out = tmp_path / "result.json"
    with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
        proc = run_script("bench_serving.py", "--base-url", url, "--model", MODEL, "--dataset", dataset,
                          "--num-groups", "2", "--prompts-per-group", "2", "--system-prompt-len", "64",
                          "--num-conversations", "2", "--num-turns", "2", "--output-len", "4",
                          "--max-concurrency", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    summary = result.get("summary") or result
    assert summary["completed"] == summary["requests"] > 0 and summary["failed"] == 0
    assert_no_leak(default_engine)


def test_bench_cluster_names_repeated_variants_apart():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_cluster

    unified, disagg = {"workers": 1}, {"mode": "disaggregated"}
    assert bench_cluster.run_names([unified, disagg, unified, disagg, unified]) == [
        "workers=1", "mode=disaggregated", "workers=1 #2", "mode=disaggregated #2", "workers=1 #3"]
