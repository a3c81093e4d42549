"""Routing decision latency of the router core (cluster/router), pure Python on one CPU core.

Workload (token ids drawn with a fixed seed): --num-prefixes shared prefixes (system prompts,
documents) of 512-1536 tokens; each request is a prefix plus a fresh suffix, or, with
probability --followup, an earlier request plus a new turn (multi-turn chat); prompts are
capped at --max-prompt tokens (about 2k). Every policy routes the same requests over
--workers workers whose trees are capped at --tree-tokens: a warm-up fills the trees, then
each `PoolRouter.route` (choose + on_routed: match every tree, insert into one) is timed. The
baseline is round_robin in the same run. A second table times one ApproximateTree:
match + insert of a prompt on a full tree.

  python benchmarks/bench_router.py --workers 8 --tree-tokens 100000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.router import ApproximateTree, PoolRouter, RouterConfig  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def hardware() -> Dict[str, str]:
    info = {"python": platform.python_version(), "cpu_count": str(os.cpu_count())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    return info


def make_workload(args) -> List[List[int]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> List[int]:
        return [rng.randrange(100, 32000) for _ in range(n)]

    prefixes = [ids(rng.randrange(512, 1537)) for _ in range(args.num_prefixes)]
    weights = [1.0 / (i + 1) for i in range(args.num_prefixes)]  # Zipf-like popularity
    prompts: List[List[int]] = []
    for _ in range(args.warmup + args.requests):
        if prompts and rng.random() < args.followup:
            prompt = rng.choice(prompts[-200:]) + ids(rng.randrange(50, 300))
        else:
            prompt = rng.choices(prefixes, weights)[0] + ids(rng.randrange(200, 800))
        prompts.append(prompt[-args.max_prompt :] if rng.random() < 0.05 else prompt[: args.max_prompt])
    return prompts


def percentiles(samples_ns: List[int]) -> Dict[str, float]:
    s = sorted(samples_ns)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] / 1e3

    return {"p50_us": pct(0.50), "p99_us": pct(0.99), "mean_us": sum(s) / len(s) / 1e3}


def bench_policy(name: str, prompts: List[List[int]], args) -> Dict:
    config = RouterConfig(max_tree_tokens=args.tree_tokens)
    router = PoolRouter(name, config, random.Random(args.seed))
    router.state.sync_members([f"worker-{i}" for i in range(args.workers)])
    in_flight: List[str] = []
    samples, reasons, matched, total = [], {}, 0, 0
    for i, prompt in enumerate(prompts):
        timed = i >= args.warmup
        t0 = time.perf_counter_ns()
        decision = router.route(prompt)
        elapsed = time.perf_counter_ns() - t0
        in_flight.append(decision.worker_id)
        if len(in_flight) > args.concurrency:  # requests finish in arrival order
            router.finish(in_flight.pop(0))
        if timed:
            samples.append(elapsed)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
            matched += decision.matched_tokens
            total += len(prompt)
    stats = router.state.stats()
    routed = [s.routed_requests for s in stats.values()]
    return {
        "policy": name,
        **percentiles(samples),
        "reasons": reasons,
        "est_hit_rate": matched / total,
        "busiest_share": max(routed) / (sum(routed) / len(routed)),
        "tree_tokens_mean": sum(s.tree_tokens for s in stats.values()) / len(stats),
        "tree_nodes_mean": sum(s.tree_nodes for s in stats.values()) / len(stats),
    }


def bench_tree(prompts: List[List[int]], args) -> Dict:
    tree = ApproximateTree(max_tokens=args.tree_tokens)
    for prompt in prompts[: args.warmup]:
        tree.insert(prompt)
    match_ns, insert_ns = [], []
    for prompt in prompts[args.warmup :]:
        t0 = time.perf_counter_ns()
        tree.match(prompt)
        t1 = time.perf_counter_ns()
        tree.insert(prompt)
        t2 = time.perf_counter_ns()
        match_ns.append(t1 - t0)
        insert_ns.append(t2 - t1)
    both = [a + b for a, b in zip(match_ns, insert_ns)]
    return {
        "match": percentiles(match_ns),
        "insert": percentiles(insert_ns),
        "match_plus_insert": percentiles(both),
        "tree_tokens": tree.size(),
        "tree_nodes": tree.num_nodes(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--tree-tokens", type=int, default=100_000, help="per-worker tree cap")
    p.add_argument("--num-prefixes", type=int, default=64)
    p.add_argument("--followup", type=float, default=0.3)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="round_robin,cache_aware,prefix_hash,power_of_two")
    p.add_argument("--out", default=os.path.join(RESULTS, "router_latency_cpu.json"))
    args = p.parse_args()

    prompts = make_workload(args)
    lengths = sorted(len(x) for x in prompts)
    hw = hardware()
    print(
        f"cpu: {hw['cpu']}  python {hw['python']}  workers {args.workers}  tree cap {args.tree_tokens} tokens"
        f"  prompt len p50 {lengths[len(lengths) // 2]} max {lengths[-1]}"
    )
    policies = [bench_policy(name, prompts, args) for name in args.policies.split(",")]
    tree = bench_tree(prompts, args)

    print("\nest hit: prompt tokens already in the chosen tree; busiest: busiest worker's requests / mean")
    print(
        f"{'policy':<14}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}{'est hit':>9}{'busiest':>9}"
        f"{'tree tok':>10}{'nodes':>7}  reasons"
    )
    for r in policies:
        print(
            f"{r['policy']:<14}{r['p50_us']:>9.1f}{r['p99_us']:>9.1f}{r['mean_us']:>9.1f}"
            f"{r['est_hit_rate']:>9.3f}{r['busiest_share']:>9.2f}{r['tree_tokens_mean']:>10.0f}"
            f"{r['tree_nodes_mean']:>7.0f}  {r['reasons']}"
        )
    print(f"\none tree ({tree['tree_tokens']} tokens, {tree['tree_nodes']} nodes), per prompt:")
    for op in ("match", "insert", "match_plus_insert"):
        print(f"  {op:<18} p50 {tree[op]['p50_us']:7.1f} us   p99 {tree[op]['p99_us']:7.1f} us")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "hardware": hw,
                "args": vars(args),
                "prompt_len_p50": lengths[len(lengths) // 2],
                "policies": policies,
                "tree": tree,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
