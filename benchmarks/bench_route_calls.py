"""Routing calls under a burst: one Serve call per prompt (Router.route) against the ingress's batched calls
(CallBatcher, Router.route_many), against a running cluster.

A burst of N prompts (--prompt-len random token ids each) asks the router for a worker at once, the way N
requests reaching one ingress replica together do; each prompt's latency is from its call to its decision.
Every decision is finished again (Router.finish), so the router's load is the same before each burst. The
two modes alternate (--rounds), so that both see the same machine. Start the cluster first
(`bash deploy/serve.sh`); this script joins its Ray cluster as a driver.

  python benchmarks/bench_route_calls.py --bursts 1 8 32 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import result_path  # noqa: E402


async def measure(args) -> List[Dict]:
    from ray import serve

    from serving.call_batcher import CallBatcher
    from cluster.router.policies import RouteRequest

    router = serve.get_deployment_handle("Router", app_name=args.app_name)
    batcher = CallBatcher("routing", lambda requests: router.route_many.remote(requests))
    rng = random.Random(args.seed)
    latencies: Dict[tuple, List[float]] = {}
    for _ in range(args.rounds):
        for mode in ("single", "batched"):
            for n in args.bursts:
                prompts = [[rng.randrange(10, 30000) for _ in range(args.prompt_len)] for _ in range(n)]

                async def one(ids):
                    start = time.perf_counter()
                    call = router.route.remote(ids) if mode == "single" else batcher.submit(RouteRequest(ids))
                    decision = await call
                    return (time.perf_counter() - start) * 1e3, decision

                results = await asyncio.gather(*[one(p) for p in prompts])
                latencies.setdefault((mode, n), []).extend(ms for ms, _ in results)
                await asyncio.gather(*[router.finish.remote(d.worker_id) for _, d in results])
    rows = []
    for (mode, n), lat in sorted(latencies.items(), key=lambda kv: (kv[0][1], kv[0][0] != "single")):
        rows.append(
            dict(
                mode=mode,
                burst=n,
                calls=len(lat),
                mean_ms=statistics.mean(lat),
                p50_ms=statistics.median(lat),
                max_ms=max(lat),
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bursts", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=10, help="bursts of each size per mode")
    p.add_argument("--app-name", default="default", help="the Serve application of `serve run`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/route-calls_<cpu>.json)")
    args = p.parse_args()

    import ray

    from bench_offline import hardware

    ray.init(address="auto", namespace="serve", logging_level="ERROR")
    rows = asyncio.run(measure(args))
    hw = hardware()
    print(f"\nrouting calls, prompts of {args.prompt_len} tokens, {args.rounds} bursts each; {hw.get('cpu')}")
    print(f"{'burst':>6} {'mode':>8} {'mean ms':>9} {'p50 ms':>9} {'max ms':>9}")
    for r in rows:
        print(f"{r['burst']:>6} {r['mode']:>8} {r['mean_ms']:>9.1f} {r['p50_ms']:>9.1f} {r['max_ms']:>9.1f}")
    hw.pop("gpu", None)  # the driver's GPU, if any, plays no part here
    path = result_path(args.out, "route-calls", hw)
    with open(path, "w") as f:
        json.dump(dict(benchmark="route_calls", hardware=hw, settings=vars(args), rows=rows), f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
