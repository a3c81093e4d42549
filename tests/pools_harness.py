"""One CPU cluster shared by the pool-scaling tests (test_admin.py, test_admin_autoscaling.py,
test_admin_dashboard.py): deployed by the first of them on Ray and Serve that stay up for the
applications of the modules after them (cluster_harness.SHARED_SERVE), so the three modules pay the
cluster's start-up once. Each test sets the pool state it needs first.

The cluster: unified pool, 1 worker to start, autoscaling 1..2 on waiting requests with short
delays, round_robin routing (a new replica gets requests at once), an API key and a distinct admin
key, report_interval_s 0.25. Engines run 2 requests at a time, so a few concurrent clients queue.
"""

import threading
import uuid
from typing import Dict, List

import httpx
import pytest

from cluster_harness import SHARED_SERVE, wait_for  # noqa: F401 - wait_for is used by the test modules

APP = "radixserve-pools-test"
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "user-key-123"
ADMIN_KEY = "admin-key-456"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _args():
    from cluster.config import ClusterArgs

    return ClusterArgs(
        workers=1,
        policy="round_robin",
        num_cpus=0.5,
        max_total_tokens=4096,
        max_running_requests=2,
        report_interval_s=0.25,
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_waiting_per_replica": 1,
            "upscale_delay_s": 1.0,
            "downscale_delay_s": 3.0,
        },
    )


@pytest.fixture(scope="module")
def pools_cluster() -> str:
    pytest.importorskip("ray")
    return SHARED_SERVE.deploy(APP, _args)


@pytest.fixture(scope="module")
def http(pools_cluster):
    with httpx.Client(base_url=pools_cluster, timeout=120) as client:
        yield client


def pool(http, name: str = "unified") -> dict:
    r = http.get(f"/admin/pools/{name}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def scale(http, name: str = "unified", **body) -> dict:
    r = http.post(f"/admin/pools/{name}/scale", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def running_ids(p: dict) -> List[str]:
    return sorted(r["replica_id"] for r in p["replicas"] if r["state"] == "running")


def settle(http, n: int, name: str = "unified", timeout: float = 240) -> dict:
    """Wait until the pool has exactly `n` routable replicas and Serve follows a target of n."""

    def done():
        p = pool(http, name)
        ok = len(running_ids(p)) == n and len(p["replicas"]) == n and p["serve_target_replicas"] == n
        return p if ok else None

    return wait_for(done, timeout, f"the {name} pool to settle at {n} replica(s)", 0.5)


def worker_logs() -> Dict[str, str]:
    """rid → worker replica that served it (every live worker's own log)."""
    from ray import serve

    handle = serve.get_deployment_handle("Worker", APP)
    out = {}
    for answer in handle.broadcast("served").results(timeout_s=30, return_exceptions=True):
        if isinstance(answer, BaseException):
            continue
        for wid, rids in answer.items():
            for rid in rids:
                out[rid] = wid
    return out


class Load:
    """`clients` threads sending /generate requests back to back until stop(); every response kept."""

    def __init__(self, base_url: str, clients: int, max_new_tokens: int = 8):
        self.base_url, self.clients, self.max_new_tokens = base_url, clients, max_new_tokens
        self.results: List[tuple] = []  # (rid, status code or exception text)
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=300) as client:
            i = 0
            while not self._stop.is_set():
                rid = f"load-{k}-{i}-{uuid.uuid4().hex[:6]}"
                body = {
                    "rid": rid,
                    "text": f"Client {k} request {i}: tell me about the sea",
                    "sampling_params": {"temperature": 0, "max_new_tokens": self.max_new_tokens},
                }
                try:
                    r = client.post("/generate", json=body, headers=USER)
                    outcome: object = r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
                except Exception as exc:  # noqa: BLE001 - recorded as a failure
                    outcome = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.results.append((rid, outcome))
                i += 1

    def __enter__(self) -> "Load":
        for k in range(self.clients):
            t = threading.Thread(target=self._run, args=(k,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    def __exit__(self, *exc) -> None:
        self.stop()

    def failures(self) -> List[tuple]:
        with self._lock:
            return [(rid, o) for rid, o in self.results if o != 200]

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def rids(self, since: int = 0) -> List[str]:
        with self._lock:
            return [rid for rid, o in self.results[since:] if o == 200]
