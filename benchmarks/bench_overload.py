"""Admission control under a burst: N requests at once against a running server (either server).

Two phases, one run, same request (a short completion, greedy, ignore_eos):
  capacity  --capacity requests at once (default 256 = the default max_running_requests): the
            server runs them all, nothing waits beyond a batch; its p99 is the reference
  burst     --burst requests at once (default 400): what exceeds max_running_requests +
            max_queued_requests must get a 503 with Retry-After, fast; the admitted ones' p99 is
            compared with the capacity p99
and, for context, one request alone (--single). Prints a table, writes JSON (hardware named) with
each phase's counts, status codes, Retry-After values, admitted p50/p99 and the slowest refusal.
Asserts nothing about timings.

    bash deploy/serve.sh served_model_name=m &     # or: python -m serving --served-model-name m
    python benchmarks/bench_overload.py --url http://127.0.0.1:8000 --model m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Dict, List

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offline import hardware  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PROMPT = "Tell me a long story about a dragon who lives in a castle near the sea and"


def _quantile(values: List[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def burst(url: str, model: str, count: int, max_tokens: int) -> Dict[str, Any]:
    """`count` completions sent at once; latency of each, by status."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> tuple:
        t0 = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json=body)
        return r.status_code, time.perf_counter() - t0, r.headers.get("retry-after")

    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        results = await asyncio.gather(*(one(client) for _ in range(count)))
    ok = sorted(t for status, t, _ in results if status == 200)
    refused = sorted(t for status, t, _ in results if status != 200)
    return {
        "requests": count,
        "admitted": len(ok),
        "refused": len(refused),
        "statuses": sorted({status for status, _, _ in results}),
        "retry_after": sorted({ra for _, _, ra in results if ra is not None}),
        "admitted_p50_s": _quantile(ok, 0.5),
        "admitted_p99_s": _quantile(ok, 0.99),
        "slowest_refusal_s": refused[-1] if refused else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="m", help="served model name")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--burst", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--label", default="", help="names the server in the JSON file name")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    phases = {}
    for name, count in (("single", 1), ("capacity", args.capacity), ("burst", args.burst)):
        phases[name] = asyncio.run(burst(args.url, args.model, count, args.max_tokens))
    ratio = phases["burst"]["admitted_p99_s"] / phases["capacity"]["admitted_p99_s"]
    print(f"{'phase':<10}{'sent':>6}{'admitted':>10}{'refused':>9}{'p50 s':>9}{'p99 s':>9}{'slowest 503 s':>15}")
    for name, r in phases.items():
        slow = "-" if r["slowest_refusal_s"] is None else f"{r['slowest_refusal_s']:.2f}"
        print(
            f"{name:<10}{r['requests']:>6}{r['admitted']:>10}{r['refused']:>9}"
            f"{r['admitted_p50_s']:>9.2f}{r['admitted_p99_s']:>9.2f}{slow:>15}"
        )
    print(f"burst admitted p99 / capacity p99: {ratio:.2f}")
    hw = hardware()
    out = args.out or os.path.join(
        RESULTS, f"overload_{args.label or 'server'}_{hw.get('gpu', 'cpu').replace(' ', '-')}.json"
    )
    with open(out, "w") as f:
        record = {"hardware": hw, "args": vars(args), "phases": phases, "burst_p99_over_capacity_p99": ratio}
        json.dump(record, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
