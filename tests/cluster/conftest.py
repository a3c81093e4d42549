"""Fixtures shared by the cluster tests that start a Serve application.

A module defines its own module-scoped `cluster` fixture (ClusterArgs, start_serve, stop_serve), which
yields the base URL; `http` is an httpx client on that URL for the module's tests (a module may define its
own, e.g. with a longer timeout).
"""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        yield client
