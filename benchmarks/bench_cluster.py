"""Cluster variants compared in one run: the same workloads against each variant of the application.

A variant is a JSON object of ClusterArgs fields laid over the common ones (--workers,
--max-total-tokens, ...); by default the two routing policies, cache_aware and round_robin. For
each variant this starts the application in-process on a local Ray cluster, runs each dataset of
bench_serving.py against it (same seeds, same arrival process), reads the cluster's cache hit rate
from /router/stats, and tears the application down before the next variant, so every variant
starts with cold caches. Prints one table and writes one JSON naming the hardware with every
summary and the ratios of the first variant to each other one.

  # routing policies (issue 4)
  python benchmarks/bench_cluster.py --workers 2 --max-total-tokens 6000 \\
      --datasets shared-prefix multi-turn -- --num-groups 8 --prompts-per-group 16 \\
      --system-prompt-len 1024 --max-concurrency 16 --output-len 16
  # unified (2 workers) vs disaggregated (1 prefill + 1 decode): named workloads (issue 6)
  python benchmarks/bench_cluster.py --variants '{"workers": 2}' \\
      '{"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 1}' \\
      --workload prefill-heavy "--dataset random --input-len 4096 --output-len 32 --request-rate 4" \\
      --workload decode-heavy "--dataset random --input-len 256 --output-len 512 --request-rate 8" \\
      -- --num-prompts 64 --range-ratio 0 --ignore-eos

Arguments after `--` go to bench_serving's workload options (see bench_serving.py --help) of every
workload; --workload LABEL "ARGS" adds a named workload with its own bench_serving options (they
come after the common ones, so they win); without --workload, each of --datasets is one workload.
--base-url and --out of bench_serving are set here.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import socket
import sys
import time
from typing import Any, Dict, List, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving as bs  # noqa: E402
from bench_offline import hardware  # noqa: E402

COMPARED = (
    ("server_cache_hit_rate", "cache hit rate"),
    ("request_throughput", "req/s"),
    ("total_throughput_tok_s", "total tok/s"),
    ("ttft_ms.p50", "TTFT p50 ms"),
    ("ttft_ms.p99", "TTFT p99 ms"),
    ("itl_ms.p50", "ITL p50 ms"),
    ("itl_ms.p99", "ITL p99 ms"),
)


def lookup(summary: Dict[str, Any], key: str) -> Optional[float]:
    """summary[key], with "a.b" reading summary[a][b]; None when absent."""
    value: Any = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return None if value is None else float(value)


def _metric(summary: Dict[str, Any], key: str) -> float:
    """lookup(), 0.0 when absent."""
    return lookup(summary, key) or 0.0


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def variant_name(variant: Dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "default"


def run_names(variants: List[Dict[str, Any]]) -> List[str]:
    """One name per run: a variant given again (interleaved repeats, `U D U D`, to see the run-to-run
    spread beside the difference) is named "<variant> #2", "#3", ..."""
    names: List[str] = []
    for variant in variants:
        name = variant_name(variant)
        seen = sum(1 for n in names if n == name or n.startswith(name + " #"))
        names.append(name if not seen else f"{name} #{seen + 1}")
    return names


FIRST_OUTPUT_COUNTERS = ("first_output_s", "first_output_requests")
"""cluster.workers.base.WorkerBase's counters of the time from a streamed call's start to its first message."""


INGRESS_COUNTERS = ("route_rpc_s", "route_rpc_calls", "first_message_s", "first_message_requests")
"""cluster.ingress.latency.IngressLatency's sums: the routing call, and the worker call → first message with tokens."""


def replica_counters(base_url: str) -> Dict[str, float]:
    """From /router/stats: the replicas' handoff counters (cluster.workers.stats.HandoffCounters, zero in
    unified mode) and first-output counters, summed over replicas, and the ingress's latency sums over every
    ingress replica (the router's totals)."""
    from cluster.workers.stats import HandoffCounters

    stats = httpx.get(f"{base_url}/router/stats", timeout=30).json()
    out = {
        k: sum(w["engine"].get(k, 0.0) for w in stats["workers"].values())
        for k in HandoffCounters.keys() + FIRST_OUTPUT_COUNTERS
    }
    out.update({k: stats["ingress"][k] for k in INGRESS_COUNTERS})
    return out


def _mean_ms(before: Dict[str, float], after: Dict[str, float], seconds: str, count: str) -> float | None:
    n = after.get(count, 0) - before.get(count, 0)
    return (after[seconds] - before[seconds]) / n * 1e3 if n else None


def ttft_split(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float | None]:
    """Means over one workload (ms): the ingress's routing call; its worker call → first message; the
    worker's own call start → first message (its transport out and back is the difference)."""
    return {
        "route_rpc_ms": _mean_ms(before, after, "route_rpc_s", "route_rpc_calls"),
        "first_message_ms": _mean_ms(before, after, "first_message_s", "first_message_requests"),
        "worker_first_output_ms": _mean_ms(before, after, "first_output_s", "first_output_requests"),
    }


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def handoff_breakdown(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """Mean milliseconds per handoff of each stage over one workload ({} when none): reserve and ready per
    handed-over request, the call's stages per returned call (cluster.workers.stats.HandoffCounters)."""
    n = after.get("handoff_requests", 0) - before.get("handoff_requests", 0)
    calls = after.get("handoff_calls", 0) - before.get("handoff_calls", 0)
    if not n or not calls:
        return {}
    out = {
        k[len("handoff_") : -2] + "_ms": (after[k] - before[k]) / (n if k in _PER_REQUEST else calls) * 1e3
        for k in after
        if k.startswith("handoff_") and k.endswith("_s")
    }
    out["overhead_ms"] = out["reserve_ms"] + out["ready_ms"] - out["prefill_compute_ms"]
    out["requests"], out["notified"] = n, after["handoff_notified"] - before["handoff_notified"]
    return out


_PER_REQUEST = ("handoff_reserve_s", "handoff_ready_s")


def warm_up(base_url: str, model: str, n: int) -> None:
    """`n` short completions, one after the other, before anything is measured: first-use costs (GPU
    kernels compiled just in time, lazy initialisation) stay out of the percentiles. Their cache
    entries are a few tokens of a prompt no workload uses."""
    for i in range(n):
        r = httpx.post(
            f"{base_url}/v1/completions",
            timeout=600,
            json={"model": model, "prompt": f"warm-up request {i}: count to ten.", "max_tokens": 4},
        )
        r.raise_for_status()


def run_variant(variant: Dict[str, Any], args, load_args: List[str], name: str = "") -> Dict[str, Any]:
    """Start the cluster of `variant`, run every dataset, stop it. Returns {dataset: summary}."""
    from ray import serve

    from cluster.app import deployment
    from cluster.config import ClusterArgs

    common = dict(
        num_cpus=args.num_cpus, max_total_tokens=args.max_total_tokens, page_size=args.page_size, report_interval_s=0.25
    )
    if variant.get("mode", "unified") == "unified":
        common["workers"] = args.workers
    cluster_args = ClusterArgs(**{**common, **variant})
    name = name or variant_name(variant)
    t0 = time.perf_counter()
    serve.run(deployment(cluster_args), name="bench", route_prefix="/")
    startup_s = time.perf_counter() - t0
    out: Dict[str, Any] = {"startup_s": startup_s}
    try:
        served = httpx.get(f"{args.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm_up(args.base_url, served, args.warmup_requests)
        for label, workload_args in args.workloads:
            # The served model's name first: --model in the load options wins.
            wl = bs.build_parser().parse_args(
                ["--model", served] + load_args + workload_args + ["--base-url", args.base_url]
            )
            sessions = bs.make_workload(wl)
            time.sleep(4 * common["report_interval_s"])  # the router's view of the counters includes the warm-up
            before = bs.server_cache_counters(wl.base_url, None)
            counters_before = replica_counters(wl.base_url)
            results, duration = asyncio.run(bs.run_load(wl, sessions))
            time.sleep(4 * common["report_interval_s"])  # the router's view of the workers' counters catches up
            after = bs.server_cache_counters(wl.base_url, None)
            out[label] = bs.summarize(results, duration, before, after)
            counters_after = replica_counters(wl.base_url)
            out[label]["handoff_ms"] = handoff_breakdown(counters_before, counters_after)
            out[label]["ttft_split_ms"] = split = ttft_split(counters_before, counters_after)
            if out[label]["handoff_ms"]:
                print(
                    f"  {name} / {label}: handoff per request (ms) "
                    + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in out[label]["handoff_ms"].items() if k != "requests"),
                    flush=True,
                )
            out[label]["output_digests"] = {
                r.key: hashlib.sha1(r.text.encode()).hexdigest()[:16] for r in results if r.ok
            }
            print(
                f"  {name} / {label}: hit rate {out[label].get('server_cache_hit_rate')}, "
                f"{out[label]['request_throughput']:.3f} req/s, TTFT p50 {out[label]['ttft_ms']['p50']:.1f} ms "
                f"(mean {out[label]['ttft_ms']['mean']:.1f} = routing call {_ms(split['route_rpc_ms'])} + worker call "
                f"to first message {_ms(split['first_message_ms'])}, of which in the worker "
                f"{_ms(split['worker_first_output_ms'])}; rest: HTTP and serving)",
                flush=True,
            )
    finally:
        serve.delete("bench")
    return out


def same_outputs(runs: Dict[str, Any], names: List[str], workloads: List[str]) -> Dict[str, Dict[str, str]]:
    """Per workload and variant: "k/n" requests whose output text equals the first variant's (greedy
    outputs are comparable where each request ran alone, e.g. at --max-concurrency 1)."""
    out: Dict[str, Dict[str, str]] = {}
    for label in workloads:
        base = runs[names[0]][label]["output_digests"]
        for name in names[1:]:
            other = runs[name][label]["output_digests"]
            same = sum(1 for key, digest in base.items() if other.get(key) == digest)
            out.setdefault(label, {})[name] = f"{same}/{len(base)}"
    return out


def main() -> None:
    argv = sys.argv[1:]
    load_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants",
        nargs="+",
        type=json.loads,
        default=[{"policy": "cache_aware"}, {"policy": "round_robin"}],
        help="JSON objects of ClusterArgs fields, one per variant (the first is the baseline of the ratios; "
        "a variant may be repeated: each repeat is a run of its own).",
    )
    p.add_argument(
        "--datasets",
        nargs="+",
        default=["shared-prefix", "multi-turn"],
        choices=["random", "shared-prefix", "multi-turn"],
    )
    p.add_argument(
        "--workload",
        nargs=2,
        action="append",
        metavar=("LABEL", "ARGS"),
        default=None,
        help="A named workload: bench_serving options in one string (repeatable; replaces --datasets).",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="Short requests sent to each variant before its workloads (not measured).",
    )
    p.add_argument("--workers", type=int, default=2, help="Unified pool size (variants may override).")
    p.add_argument("--num-cpus", type=float, default=0.5, help="Ray CPUs per worker replica.")
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray cluster.")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool per worker (cache pressure).")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(own)
    args.workloads = (
        [(label, shlex.split(opts)) for label, opts in args.workload]
        if args.workload
        else [(dataset, ["--dataset", dataset]) for dataset in args.datasets]
    )

    import ray
    from ray import serve

    os.environ.setdefault("RAY_SERVE_USE_GRPC_BY_DEFAULT", "1")  # as deploy/serve.sh and the image run it
    os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")  # likewise
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")  # likewise
    from cluster.ingress.haproxy_launcher import binary_path_env

    os.environ.update(binary_path_env())  # likewise: HAProxy's stats page and exporter on 127.0.0.1
    radixserve_env = {k: v for k, v in os.environ.items() if k.startswith(("RADIXSERVE_", "RAY_SERVE_"))}
    ray.init(
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                **radixserve_env,
            }
        },
    )
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args.base_url = f"http://127.0.0.1:{port}"
    names = run_names(args.variants)
    runs = {}
    try:
        for name, variant in zip(names, args.variants):
            print(f"variant {name}: starting", flush=True)
            runs[name] = run_variant(variant, args, load_args, name)
    finally:
        serve.shutdown()
        ray.shutdown()

    base = names[0]
    ratios: Dict[str, Dict[str, Dict[str, float]]] = {}
    print(f"\n{'dataset':<14} {'metric':<14} " + " ".join(f"{n[:24]:>24}" for n in names))
    for dataset, _ in args.workloads:
        for key, label in COMPARED:
            values = [_metric(runs[n][dataset], key) for n in names]
            print(f"{dataset:<14} {label:<14} " + " ".join(f"{v:>24.3f}" for v in values))
            for p, v in zip(names[1:], values[1:]):
                ratios.setdefault(dataset, {}).setdefault(f"{base}/{p}", {})[key] = values[0] / v if v else None
    print(json.dumps(ratios, indent=1))
    same = same_outputs(runs, names, [label for label, _ in args.workloads])
    for dataset, counts in same.items():
        print(f"{dataset}: outputs identical to {base}'s: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    os.makedirs(bs.RESULTS, exist_ok=True)
    out = args.out or os.path.join(bs.RESULTS, default_file_name(names, args.max_total_tokens))
    with open(out, "w") as f:
        json.dump(
            {
                "hardware": {**hardware(), "gpus": _gpu_count()},
                "args": vars(args),
                "load_args": load_args,
                "runs": runs,
                "ratios": ratios,
                "same_outputs_as_first_variant": same,
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


MAX_FILE_NAME = 200
"""Longest default result file name (file systems allow 255 bytes): longer ones are cut and get a hash."""


def default_file_name(names: List[str], max_total_tokens: Optional[int]) -> str:
    """cluster_<variant>-vs-<variant>..._kv<N>.json from the run names; when that is longer than
    MAX_FILE_NAME, its start and a hash of the whole (so that other variant lists get other names)."""
    stem = "cluster_" + "-vs-".join(n.replace("=", "").replace(",", "_").replace(" ", "") for n in names)
    tail = f"_kv{max_total_tokens}.json"
    if len(stem) + len(tail) <= MAX_FILE_NAME:
        return stem + tail
    digest = hashlib.sha1(stem.encode()).hexdigest()[:12]
    return stem[: MAX_FILE_NAME - len(tail) - len(digest) - 1] + "-" + digest + tail


if __name__ == "__main__":
    main()
