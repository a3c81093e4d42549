"""Start and stop a local CPU Ray cluster running one radixserve application (cluster tests).

url = start_serve(ClusterArgs(...), app="name")   # ray.init(num_cpus=2) + Serve on a free port
...
stop_serve()

or, for modules next to each other that share Ray and Serve (tests/cluster/conftest.py stops them):

url = SHARED_SERVE.deploy("name", lambda: ClusterArgs(...))
"""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "UCX_TLS": "tcp,self",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    "RAY_SERVE_HAPROXY_NBTHREAD": "1",
    "RADIXSERVE_NIXL_PROGRESS_THREAD": "0",
}
"""Environment of every replica: offline model files, one thread per engine (2 CPUs are shared),
UCX over TCP for NIXL in host memory, Serve's handles over gRPC, HAProxy in front and Serve's throughput
preset as deploy/serve.sh and the image set them (also in this process, whose local Ray cluster the
proxy inherits it from). A stopping ingress replica leaves at once: with HAProxy, Serve keeps it
reachable for 30 s so that load balancers in front can deregister it, and none is in front of a test.
For these 2 CPUs, two settings differ from a GPU host's: HAProxy runs one thread, not Serve's default 4,
and NIXL's progress thread is off (cluster/kv_transfer/nixl.py: the receiver then completes a WRITE while
it waits for it, as a decode replica always does); their polling otherwise takes CPU time from the engines.
tests/cluster/test_kv_transfer.py runs NIXL with the progress thread, in this process."""


RAY_REGISTER_TIMEOUT = ("RAY_worker_register_timeout_seconds", "180")
"""Read by the raylet that ray.init starts (a child of this process): how long a new Ray worker process may
take to register. Ray's 60 s default is missed when the 2 CPUs are overloaded (every replica imports torch)
and Ray then refuses the actor ("worker startup repeatedly failed")."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args, app: str, env: Optional[Dict[str, str]] = None) -> str:
    """ray.init(num_cpus=2), Serve's HTTP proxy on a free port, `cluster.app:deployment(args)` deployed
    as `app`. `env` overrides WORKER_ENV (e.g. RAY_SERVE_ENABLE_HA_PROXY=0: Serve's Python proxy in front).
    Returns the base URL."""
    import ray
    from ray import serve

    from cluster.app import deployment
    from cluster.ingress.haproxy_launcher import binary_path_env

    env = env or {}
    for name in ("RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED"):
        # read by the driver's Serve too
        os.environ[name] = env.get(name, WORKER_ENV[name])
    # HAProxy's stats and Prometheus ports are fixed (8404, 9101) unless set: free ones, so that a second
    # test cluster on this machine (another checkout's tests) cannot fail to start on a taken port.
    ports = {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
    ports.update(binary_path_env())  # HAProxy started as deploy/serve.sh starts it, where the project is installed
    os.environ.update(ports)
    os.environ.setdefault(*RAY_REGISTER_TIMEOUT)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {**WORKER_ENV, **ports, **env}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(deployment(args), name=app, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


class SharedServe:
    """Ray and Serve kept up for test modules that run one after another: started by the first test that
    deploys an application (`deploy`), stopped once the next test is in none of `modules` (`stop_after`,
    called by tests/cluster/conftest.py after every test), since a process holds one Ray cluster at a time
    and the next module may start its own. One application at a time: deploying another one deletes the
    one before (each is sized for the test cluster's 2 CPUs), so modules that deploy the same application
    share it, and a module with other ClusterArgs pays for its application's start only, not for Ray's and
    Serve's. A module that shares an application brings it to the state its tests need first."""

    def __init__(self, modules: Tuple[str, ...]):
        self.modules = modules
        self._url: Optional[str] = None
        self._app: Optional[str] = None

    def deploy(self, app: str, args: Callable[[], object]) -> str:
        """The base URL of application `app`, deployed from `args()` unless it is the one running."""
        if self._app == app:
            return self._url
        try:
            if self._url is None:
                self._url = start_serve(args(), app)
            else:
                from ray import serve

                from cluster.app import deployment

                serve.delete(self._app)
                self._app = None
                serve.run(deployment(args()), name=app, route_prefix="/")
                # the proxy's route to "/" changed application: wait until it reaches the new one
                wait_for(lambda: _answers(f"{self._url}/health"), 60, f"{app} behind the proxy", 0.5)
            self._app = app
        except BaseException:
            self.stop()  # a half-started cluster must not block the next module's ray.init
            raise
        return self._url

    def stop(self) -> None:
        import ray

        self._url = self._app = None
        if ray.is_initialized():
            stop_serve()

    def stop_after(self, nextitem) -> None:
        if self._url is not None and (nextitem is None or nextitem.path.name not in self.modules):
            self.stop()


SHARED_SERVE = SharedServe(
    (
        "test_admin.py",
        "test_admin_autoscaling.py",
        "test_admin_dashboard.py",
        "test_admission.py",
        "test_disaggregated.py",
        "test_disaggregated_admin.py",
        "test_disaggregated_core_process.py",
        "test_disaggregated_tp.py",
    )
)
"""Ray and Serve with HAProxy in front for these modules, run one after another (tests/cluster/conftest.py
orders them so): the pool-scaling tests' application (pools_harness.py), test_admission.py's, then the
disaggregated one (disagg_harness.py), then its tensor-parallel variant (test_disaggregated_tp.py)."""


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE_SH_URL = "http://127.0.0.1:8000"
"""Where `bash deploy/serve.sh` answers (Serve's default HTTP port)."""


@contextlib.contextmanager
def serve_sh(*args: str, log_path: str, timeout: float = 300.0) -> Iterator[subprocess.Popen]:
    """`bash deploy/serve.sh ARGS` (the README's run command) in a session of its own, output to `log_path`,
    until its OpenAI endpoint on SERVE_SH_URL lists a model (at most `timeout` s). Yields the process; on
    exit, if it still runs, SIGTERM (its drain, as a user stops it), then SIGKILL of its group after 120 s."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            raise AssertionError("port 8000 is taken: deploy/serve.sh needs it")
    # As a user starts it: without the Serve settings that start_serve leaves in this process's environment
    # (a test's Python proxy instead of HAProxy, its HAProxy ports), nor a Ray cluster's address.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_") and k != "RAY_ADDRESS"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", os.path.join(ROOT, "deploy", "serve.sh"), *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:

            def up() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"serve.sh {' '.join(args)} exited with {proc.returncode}; see {log_path}")
                return _answers(f"{SERVE_SH_URL}/v1/models")

            wait_for(up, timeout, f"serve.sh {' '.join(args)} to answer (log: {log_path})", interval=1.0)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns something truthy (returned); AssertionError after `timeout` s."""
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


async def abort_storm(
    base_url: str,
    model: str,
    total: int = 120,
    concurrency: int = 24,
    seed: int = 0,
    headers: Optional[Dict[str, str]] = None,
) -> Dict:
    """`total` requests, `concurrency` at a time, about half of them closed by the client at a random moment
    in their first second: before routing answers, before the first token (longer prompts), or mid-stream.
    Completions and chat, streamed and not, with `headers` (e.g. an API key). Returns counts of "completed",
    "aborted" and "error" (non-200).

    Behind HAProxy an ingress learns of a closed client when it next writes to it: a streamed request is
    aborted at its next token, a non-streamed one runs to its end (its pages are freed then)."""
    import asyncio
    import collections
    import random

    import httpx

    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    gate = asyncio.Semaphore(concurrency)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()

    async def one(client: httpx.AsyncClient) -> None:
        kind = rng.choice(["completion", "completion-stream", "chat-stream", "chat"])
        prompt = " ".join(rng.choice(words) for _ in range(rng.choice([8, 64, 200])))
        abort_after = rng.uniform(0.0, 1.0) if rng.random() < 0.5 else None
        body = {"model": model, "max_tokens": rng.randint(4, 24), "temperature": 0, "ignore_eos": True}
        if kind.startswith("chat"):
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        body["stream"] = kind.endswith("stream")

        async def run() -> int:
            if body["stream"]:
                async with client.stream("POST", path, json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                    return r.status_code
            return (await client.post(path, json=body)).status_code

        async with gate:
            try:
                status = await (run() if abort_after is None else asyncio.wait_for(run(), abort_after))
                counts["completed" if status == 200 else "error"] += 1
            except asyncio.TimeoutError:
                counts["aborted"] += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers) as client:
        await asyncio.gather(*(one(client) for _ in range(total)))
    return dict(counts)


def cluster_idle(stats: Dict) -> bool:
    """/router/stats shows nothing left anywhere: no request in flight at the router, none running or
    waiting in an engine, every KV page free or held only by the prefix cache."""
    for w in stats["workers"].values():
        e = w["engine"]
        if w["in_flight"] or e.get("running", 1) or e.get("waiting", 1):
            return False
        if e.get("kv_free_tokens", 0) + e.get("kv_evictable_tokens", 0) != e.get("kv_total_tokens", -1):
            return False
    return bool(stats["workers"])


async def streams_across_a_kill(
    base_url: str, bodies: List[dict], kill: Callable[[], None], headers: Optional[Dict[str, str]] = None
) -> Tuple[List[str], List[Tuple[str, float]]]:
    """Each completion body (greedy) once undisturbed, then all at once as streams; once every stream has
    4 events, `kill()` runs (a replica dies). Returns (undisturbed texts, per stream (text, largest gap
    in seconds between two of its events)). Every stream must answer 200, carry no error event and end
    with [DONE]."""
    import httpx

    started, all_started = 0, asyncio.Event()

    async def one(client, body: dict) -> Tuple[str, float]:
        nonlocal started
        text, events, last, gap = "", 0, None, 0.0
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                now = asyncio.get_running_loop().time()
                gap, last, events = (0.0 if last is None else max(gap, now - last)), now, events + 1
                if line == "data: [DONE]":
                    return text, gap
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                if events == 4:
                    started += 1
                    if started == len(bodies):
                        all_started.set()
        raise AssertionError(f"the stream ended without [DONE] after {events} events")

    async with httpx.AsyncClient(base_url=base_url, timeout=300, headers=headers) as client:
        undisturbed = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        reference = [r.json()["choices"][0]["text"] for r in undisturbed]
        tasks = [asyncio.ensure_future(one(client, b)) for b in bodies]
        await asyncio.wait_for(all_started.wait(), 240)
        kill()
        return reference, list(await asyncio.gather(*tasks))


def router_stats(http, headers: Optional[Dict[str, str]] = None) -> dict:
    """GET /router/stats through an httpx client on the cluster's URL (with `headers`: the admin key where
    one is set), asserting a 200."""
    r = http.get("/router/stats", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()
