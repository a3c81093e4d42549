"""Fixtures shared by every test folder: the GPU marker's skip, engines on the default model (CPU, float32).

Helpers that tests import (prompts, make_engine, assert_no_leak) live in engine_harness.py: a test module
never imports a conftest (each folder may have its own).
"""

from __future__ import annotations

import os

import pytest

from engine_harness import make_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


RAY_PATHS = ("tests/cluster/", "tests/deploy/test_helm.py")
"""Tests that start Ray or a server on a fixed port. tests/run.sh runs pytest-xdist with two workers and
`--dist loadscope`, and pytest_xdist_make_scheduler below makes these one scope: one worker runs them all,
first and in order, so that one Ray cluster is up at a time (a process holds one, and the cluster modules
size theirs for the machine's 2 CPUs) and the modules of tests/cluster/conftest.py's SHARED_SERVE stay next
to each other. Every other test is a scope of its own, for whichever worker is free."""


def _starts_ray(nodeid: str) -> bool:
    return nodeid.startswith(RAY_PATHS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    items.sort(key=lambda item: not _starts_ray(item.nodeid))  # stable: the longest scope starts first


OTHER_TESTS_NICENESS = 10
"""Under pytest-xdist, a worker lowers its CPU priority by this much (os.nice, inherited by the engine and server
processes its tests start) before its first test outside RAY_PATHS (the Ray scope runs first on its worker).
The Ray tests' replicas start, fail over and scale against timeouts, and Ray's own loops cost CPU for as long
as they run, so the 2 CPUs go to them first and the other tests take what they leave. The Ray scope is the
run's longest path and keeps both CPUs busy most of its time. The other tests still get about a quarter of
the CPUs while both want them (CFS weights of niceness 10 and 5), so their own timeouts (server start-up,
idle waits) keep a margin.

Ray starts its worker processes (Serve's controller, proxies and replicas) at niceness RAY_WORKER_NICENESS,
not at the test process's 0: Ray's own default is 15, which would put them below the other tests' worker. The
raylet and GCS stay at 0, above the workers, as Ray intends (they schedule and health-check them)."""

RAY_WORKER_NICENESS = 5
os.environ.setdefault("RAY_worker_niceness", str(RAY_WORKER_NICENESS))  # read when a test starts Ray's raylet

_niced = False


def pytest_runtest_setup(item):
    global _niced
    if not _niced and hasattr(item.config, "workerinput") and not _starts_ray(item.nodeid):
        _niced = True
        os.nice(OTHER_TESTS_NICENESS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope`, with the scopes of RAY_PATHS's docstring. (Not `--dist loadgroup` with xdist_group
    marks: pytest-xdist 3.8 names a group by appending it to `item._nodeid`, which pytest 9's node ids no longer
    read. `_split_scope` is the method LoadScopeScheduling's own subclasses override; xdist is pinned.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if _starts_ray(nodeid) else nodeid

    return RayScopeScheduling(config, log)


@pytest.fixture(scope="session")
def default_engine():
    engine = make_engine()
    yield engine
    engine.shutdown()
