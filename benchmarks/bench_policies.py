"""Routing policies compared in one run: the same cluster, the same workloads, one policy at a time.

For each policy (default: cache_aware, then round_robin) this starts the application in-process on
a local Ray cluster (`cluster.app:deployment` with --workers, --max-total-tokens, ...), runs each
dataset of bench_serving.py against it (same seeds, same arrival process), reads the cluster's
cache hit rate from /router/stats, and tears the application down before the next policy, so
every policy starts with cold caches. Prints one table and writes one JSON naming the hardware
with every summary and the ratios of the first policy to each other one.

  python benchmarks/bench_policies.py --workers 2 --max-total-tokens 6000 \\
      --datasets shared-prefix multi-turn -- --num-groups 8 --prompts-per-group 16 \\
      --system-prompt-len 1024 --max-concurrency 16 --output-len 16

Arguments after `--` go to bench_serving's workload options (see bench_serving.py --help);
--dataset, --base-url and --out there are set here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving as bs  # noqa: E402
from bench_offline import hardware  # noqa: E402

COMPARED = (("server_cache_hit_rate", "cache hit rate"), ("request_throughput", "req/s"),
            ("total_throughput_tok_s", "total tok/s"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_policy(policy: str, args, load_args: List[str]) -> Dict[str, Any]:
    """Start the cluster with `policy`, run every dataset, stop it. Returns {dataset: summary}."""
    from ray import serve

    from cluster.app import deployment
    from cluster.config import ClusterArgs

    cluster_args = ClusterArgs(workers=args.workers, policy=policy, num_cpus=args.num_cpus,
                               max_total_tokens=args.max_total_tokens, page_size=args.page_size,
                               report_interval_s=0.25)
    t0 = time.perf_counter()
    serve.run(deployment(cluster_args), name="bench", route_prefix="/")
    startup_s = time.perf_counter() - t0
    out: Dict[str, Any] = {"startup_s": startup_s}
    try:
        for dataset in args.datasets:
            wl = bs.build_parser().parse_args(load_args + ["--dataset", dataset, "--base-url", args.base_url])
            sessions = bs.make_workload(wl)
            before = bs.server_cache_counters(wl.base_url, None)
            results, duration = asyncio.run(bs.run_load(wl, sessions))
            after = bs.server_cache_counters(wl.base_url, None)
            out[dataset] = bs.summarize(results, duration, before, after)
            print(f"  {policy} / {dataset}: hit rate {out[dataset].get('server_cache_hit_rate')}, "
                  f"{out[dataset]['request_throughput']:.3f} req/s", flush=True)
    finally:
        serve.delete("bench")
    return out


def main() -> None:
    argv = sys.argv[1:]
    load_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--datasets", nargs="+", default=["shared-prefix", "multi-turn"],
                   choices=["random", "shared-prefix", "multi-turn"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-cpus", type=float, default=0.5, help="Ray CPUs per worker replica.")
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray cluster.")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool per worker (cache pressure).")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(own)

    import ray
    from ray import serve

    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                       "TRANSFORMERS_OFFLINE": "1"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args.base_url = f"http://127.0.0.1:{port}"
    runs = {}
    try:
        for policy in args.policies:
            print(f"policy {policy}: starting {args.workers} workers", flush=True)
            runs[policy] = run_policy(policy, args, load_args)
    finally:
        serve.shutdown()
        ray.shutdown()

    base = args.policies[0]
    ratios: Dict[str, Dict[str, Dict[str, float]]] = {}
    print(f"\n{'dataset':<14} {'metric':<14} " + " ".join(f"{p:>14}" for p in args.policies))
    for dataset in args.datasets:
        for key, label in COMPARED:
            values = [runs[p][dataset].get(key) or 0.0 for p in args.policies]
            print(f"{dataset:<14} {label:<14} " + " ".join(f"{v:>14.3f}" for v in values))
            for p, v in zip(args.policies[1:], values[1:]):
                ratios.setdefault(dataset, {}).setdefault(f"{base}/{p}", {})[key] = values[0] / v if v else None
    print(json.dumps(ratios, indent=1))
    os.makedirs(bs.RESULTS, exist_ok=True)
    out = args.out or os.path.join(bs.RESULTS, f"policies_{'-vs-'.join(args.policies)}_{args.workers}w_"
                                   f"kv{args.max_total_tokens}_cpu.json")
    with open(out, "w") as f:
        json.dump({"hardware": hardware(), "args": vars(args), "load_args": load_args, "runs": runs,
                   "ratios": ratios}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
