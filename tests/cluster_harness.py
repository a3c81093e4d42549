"""Start and stop a local CPU Ray cluster running one radixserve application (cluster tests).

url = start_serve(ClusterArgs(...), app="name")   # ray.init(num_cpus=2) + Serve on a free port
...
stop_serve()
"""

import os
import socket
import time
from typing import Callable, Dict, Optional

WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "UCX_TLS": "tcp,self",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
}
"""Environment of every replica: offline model files, one thread per engine (2 CPUs are shared),
UCX over TCP for NIXL in host memory, Serve's handles over gRPC and HAProxy in front as deploy/serve.sh
and the image set them (also in this process, whose local Ray cluster the proxy inherits it from). A
stopping ingress replica leaves at once: with HAProxy, Serve keeps it reachable for 30 s so that load
balancers in front can deregister it, and none is in front of a test."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args, app: str, env: Optional[Dict[str, str]] = None) -> str:
    """ray.init(num_cpus=2), Serve's HTTP proxy on a free port, `cluster.app:deployment(args)` deployed
    as `app`. Returns the base URL."""
    import ray
    from ray import serve

    from cluster.app import deployment

    os.environ.setdefault("RAY_SERVE_USE_GRPC_BY_DEFAULT", WORKER_ENV["RAY_SERVE_USE_GRPC_BY_DEFAULT"])
    os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", WORKER_ENV["RAY_SERVE_ENABLE_HA_PROXY"])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {**WORKER_ENV, **(env or {})}},
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
