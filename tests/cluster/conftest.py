"""Fixtures shared by the cluster tests that start a Serve application.

A module defines its own module-scoped `cluster` fixture (ClusterArgs, start_serve, stop_serve), which
yields the base URL, or deploys its application on the Ray and Serve that test_admin*.py, test_admission.py
and test_disaggregated*.py share (cluster_harness.SHARED_SERVE): those modules run one after another (see
pytest_collection_modifyitems), and Ray stops after the last of them. `http` is an httpx client on the
cluster's URL for the module's tests (a module may define its own, e.g. with a longer timeout or an API key).
"""

from __future__ import annotations

import httpx
import pytest

import disagg_harness
from cluster_harness import SHARED_SERVE


def pytest_collection_modifyitems(items) -> None:
    """The modules of SHARED_SERVE run one after another, from where the first of them is: a process holds
    one Ray cluster at a time, so a module with a cluster of its own sorted between them (test_cluster.py,
    Serve's Python proxy in front) runs after them. The order is otherwise unchanged."""
    first = next((i for i, item in enumerate(items) if item.path.name in SHARED_SERVE.modules), None)
    if first is not None:
        order = sorted(range(len(items)), key=lambda i: (first if items[i].path.name in SHARED_SERVE.modules else i, i))
        items[:] = [items[i] for i in order]


def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the shared Ray and Serve once the next test is not in one of the modules that share them."""
    SHARED_SERVE.stop_after(nextitem)


@pytest.fixture(scope="module")
def disagg_cluster() -> str:
    """Base URL of the disaggregated application of test_disaggregated*.py (disagg_harness.py)."""
    pytest.importorskip("ray")
    pytest.importorskip("nixl_cu13._api")
    return SHARED_SERVE.deploy(disagg_harness.APP, disagg_harness.args)


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        yield client
