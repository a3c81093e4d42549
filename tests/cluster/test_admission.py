"""Admission control in the cluster (real local Ray cluster, CPU): 2 workers that admit 2 requests each
(max_running_requests=2, max_queued_requests=0), and a rate limit of 30 requests per minute per API key
at the ingress (the admission tests send fewer, without a key; the rate-limit test runs last). The
application replaces the pool-scaling tests' on the same Ray and Serve (cluster_harness.SHARED_SERVE).

- a worker that refuses (queue_full) has the request routed to another worker of the pool;
- when every worker has refused or is full, the ingress answers 503 queue_full with Retry-After, and a
  full pool (by the router's count) is refused without any worker being called.

The router counts requests and an engine counts choices, so a request with n=2 fills a worker of 2 while
the router still sees room there: that is how a worker's own refusal is provoked. Nothing here asserts on
timings.
"""

import asyncio
import contextlib
import json

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.config import ClusterArgs  # noqa: E402
from cluster.router.policies import PoolFullError  # noqa: E402
from cluster_harness import SHARED_SERVE, cluster_idle, router_stats, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

APP = "radixserve-admission"


def _args() -> ClusterArgs:
    return ClusterArgs(
        workers=2,
        policy="round_robin",
        num_cpus=0.5,
        max_total_tokens=16384,
        max_running_requests=2,
        max_queued_requests=0,
        report_interval_s=0.25,
        rate_limit_requests_per_minute=30,
    )


@pytest.fixture(scope="module")
def cluster():
    return SHARED_SERVE.deploy(APP, _args)


def _served() -> dict:
    """rid → the workers whose submit it reached (a refused submit is recorded too)."""
    out: dict = {}
    for answer in serve.get_deployment_handle("Worker", APP).broadcast("served").results(timeout_s=30):
        for wid, rids in answer.items():
            for rid in rids:
                out.setdefault(rid, []).append(wid)
    return out


def _generate(rid: str, n: int = 1, max_new_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "rid": rid,
        "text": f"Request {rid} tells a long story:",
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "n": n, "ignore_eos": True},
    }


@contextlib.contextmanager
def _running(http, rid: str, n: int = 1):
    """A long streamed request, running (its first event has come) until the block ends (then closed:
    the ingress aborts it on its worker)."""
    with http.stream("POST", "/generate", json=_generate(rid, n, max_new_tokens=3000, stream=True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept open: closing this iterator would close the connection
        line = next(lines)
        while not line.startswith("data: {"):
            line = next(lines)
        assert "error" not in json.loads(line[len("data: ") :])
        yield


def _in_flight(http) -> dict:
    return {w: v["in_flight"] for w, v in router_stats(http)["workers"].items()}


def test_full_worker_hands_the_request_to_another_then_503(cluster, http):
    wait_for(
        lambda: [v["capacity"] for v in router_stats(http)["workers"].values()] == [2, 2],
        60,
        "both workers to report their capacity",
    )
    with _running(http, "a", n=2):  # fills its worker's engine; the router counts 1
        (w_a,) = [w for w, c in _in_flight(http).items() if c == 1]
        with _running(http, "b"):  # round_robin: the other worker
            (w_b,) = [w for w in _in_flight(http) if w != w_a]
            assert _served()["b"] == [w_b]
            # round_robin picks w_a (room by the router's count), which refuses: w_b takes it
            with _running(http, "c"):
                assert sorted(_served()["c"]) == sorted([w_a, w_b])
                assert _in_flight(http) == {w_a: 1, w_b: 2}
                # w_b full by the router's count; w_a refuses: nothing left
                r = http.post("/generate", json=_generate("d"))
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                assert _served()["d"] == [w_a]
    # The router's count drops when the ingress ends a request; the worker's engine frees its slot when it
    # next steps: wait for both (the workers report every 0.25 s), or a refusal from a still-full engine races.
    wait_for(lambda: cluster_idle(router_stats(http)), 60, "nothing in flight at the router or in an engine")
    r = http.post("/generate", json=_generate("e"))
    assert r.status_code == 200, r.text  # admitted again


def test_full_pool_is_refused_without_calling_a_worker(cluster, http):
    router = serve.get_deployment_handle("Router", APP)
    with _running(http, "f1"), _running(http, "f2"), _running(http, "f3"), _running(http, "f4"):
        assert set(_in_flight(http).values()) == {2}
        r = http.post("/generate", json=_generate("g"))
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        assert "g" not in _served()
        with pytest.raises(PoolFullError):  # the router's own refusal (the ingress refused first here)
            router.route.remote([1, 2, 3]).result(timeout_s=30)
    wait_for(lambda: set(_in_flight(http).values()) == {0}, 60, "the router to count nothing in flight")


def _replica_environ(deployment: str) -> list:
    """Environment of each live replica process of `deployment` in APP (Ray names them
    ray::ServeReplica:<app>:<deployment>)."""
    import psutil

    title = f"ServeReplica:{APP}:{deployment}"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if title in " ".join(proc.info["cmdline"] or ()):
                found.append(proc.environ())
        except psutil.Error:  # the process ended meanwhile, or is not ours
            continue
    return found


def test_ingress_replicas_run_asyncio_event_loop(cluster):
    """The default ingress_event_loop with CPU workers: Ray builds the replica's loop without uvloop
    (RAY_USE_UVLOOP=0 in its process), whose accept takes every pending connection at once instead of one
    per turn."""
    envs = _replica_environ("Ingress")
    assert envs, "no ingress replica process found"
    assert all(env.get("RAY_USE_UVLOOP") == "0" for env in envs)


def test_rate_limit_per_key_at_the_ingress(cluster, http):
    """40 requests of one key at once against 30 per minute: the excess gets OpenAI's 429 with Retry-After
    and the x-ratelimit headers (of those the limit let through, what the 4 places of the pool cannot hold
    gets its 503 queue_full); another key is not affected."""

    async def burst() -> list:
        headers = {"Authorization": "Bearer rl-key"}
        async with httpx.AsyncClient(base_url=cluster, timeout=120, headers=headers) as client:
            return await asyncio.gather(*(client.post("/generate", json=_generate(f"rl{i}")) for i in range(40)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and {r.status_code for r in responses} <= {200, 429, 503}
    assert all(r.json()["error"]["code"] == "queue_full" for r in responses if r.status_code == 503)
    for r in refused:
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded"), err
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-limit-requests"] == "30"
    assert all(r.headers["x-ratelimit-limit-requests"] == "30" for r in responses)
    other = http.post("/generate", json=_generate("rl-other"), headers={"Authorization": "Bearer other-key"})
    # Its bucket is full but for this request: 29 left, or 30 again when the reply took over 2 s (a bucket of 30
    # per minute refills one every 2 s, and the header is read when the reply is sent).
    assert other.status_code == 200 and other.headers["x-ratelimit-remaining-requests"] in ("29", "30")
