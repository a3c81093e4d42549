"""Admission control under a burst: N requests at once against a running server (either server).

Two phases, one run, same request (a short completion, greedy, ignore_eos):
  capacity  --capacity requests at once (default 256 = the default max_running_requests): the
            server runs them all, nothing waits beyond a batch; its p99 is the reference
  burst     --burst requests at once (default 400): what exceeds max_running_requests +
            max_queued_requests must get a 503 with Retry-After, fast; the admitted ones' p99 is
            compared with the capacity p99
and, for context, one request alone. Prints a table, writes JSON (hardware named) with each
phase's counts, status codes, Retry-After values, admitted p50/p99 and the slowest refusal, each
counted two ways: from the burst start (what a user who fires them at once sees) and from the
request's own send (its last byte written to the socket: the server's share, with the client's delay
in reading the answer), and when the client had sent them (last send: from the burst start, its
connections included; send spread: first send to last send). Asserts nothing about timings. The JSON
holds a list of runs (`--append` adds one to a file's runs, e.g. one run per server start).

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
from typing import Any, Dict, List, Optional, Tuple

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offline import hardware  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PROMPT = "Tell me a long story about a dragon who lives in a castle near the sea and"


def _quantile(values: List[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def burst(url: str, model: str, count: int, max_tokens: int) -> Dict[str, Any]:
    """`count` completions sent at once; latency of each, by status, counted two ways.

    From the burst start (one clock read before all `count` are handed to the event loop): what a user
    who fires them at once sees, the client's own cost included. From the request's own send (httpcore's
    trace event "http11.send_request_body.complete": its last byte written to the socket): the server's
    share, plus the client's delay in reading an answer that has already arrived. first_send_s /
    last_send_s: from the burst start (opening the connections included); send_spread_s: first send to
    last send."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def one(client: httpx.AsyncClient, start: float) -> Tuple[int, float, float, Optional[str]]:
        """(status, seconds from `start` to the answer, seconds from `start` to the send, Retry-After)."""
        sent: List[float] = []

        async def trace(event: str, info: Dict[str, Any]) -> None:
            if event.startswith("http11.send_request_"):  # the last one: the body written (or failed)
                sent.append(time.perf_counter())

        r = await client.post(f"{url}/v1/completions", json=body, extensions={"trace": trace})
        end = time.perf_counter()
        return r.status_code, end - start, sent[-1] - start, r.headers.get("retry-after")

    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, start) for _ in range(count)))
    sends = sorted(sent for _, _, sent, _ in results)
    ok = sorted(t for status, t, _, _ in results if status == 200)
    ok_from_send = sorted(t - sent for status, t, sent, _ in results if status == 200)
    refused = sorted(t for status, t, _, _ in results if status != 200)
    refused_from_send = sorted(t - sent for status, t, sent, _ in results if status != 200)
    return {
        "requests": count,
        "admitted": len(ok),
        "refused": len(refused),
        "statuses": sorted({status for status, _, _, _ in results}),
        "retry_after": sorted({ra for _, _, _, ra in results if ra is not None}),
        "admitted_p50_s": _quantile(ok, 0.5),
        "admitted_p99_s": _quantile(ok, 0.99),
        "slowest_refusal_s": refused[-1] if refused else None,
        "first_send_s": sends[0],
        "last_send_s": sends[-1],
        "send_spread_s": sends[-1] - sends[0],
        "admitted_p50_from_send_s": _quantile(ok_from_send, 0.5),
        "admitted_p99_from_send_s": _quantile(ok_from_send, 0.99),
        "refusal_p50_s": _quantile(refused, 0.5) if refused else None,
        "refusal_p50_from_send_s": _quantile(refused_from_send, 0.5) if refused else None,
        "slowest_refusal_from_send_s": refused_from_send[-1] if refused else None,
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
    p.add_argument("--append", action="store_true", help="add this run to the runs already in --out")
    args = p.parse_args()

    phases = {}
    for name, count in (("single", 1), ("capacity", args.capacity), ("burst", args.burst)):
        phases[name] = asyncio.run(burst(args.url, args.model, count, args.max_tokens))
    ratio = phases["burst"]["admitted_p99_s"] / phases["capacity"]["admitted_p99_s"]
    ratio_from_send = phases["burst"]["admitted_p99_from_send_s"] / phases["capacity"]["admitted_p99_from_send_s"]
    print(f"{'':<28}{'from the burst start':^27}{'from the request send':^27}")
    print(
        f"{'phase':<10}{'sent':>6}{'admitted':>9}{'refused':>8}{'p50 s':>8}{'p99 s':>8}{'slowest 503':>12}"
        f"{'p50 s':>8}{'p99 s':>8}{'slowest 503':>12}{'last send s':>13}{'send spread s':>15}"
    )

    def secs(value: Optional[float], width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"

    for name, r in phases.items():
        print(
            f"{name:<10}{r['requests']:>6}{r['admitted']:>9}{r['refused']:>8}"
            f"{secs(r['admitted_p50_s'], 8)}{secs(r['admitted_p99_s'], 8)}{secs(r['slowest_refusal_s'], 12)}"
            f"{secs(r['admitted_p50_from_send_s'], 8)}{secs(r['admitted_p99_from_send_s'], 8)}"
            f"{secs(r['slowest_refusal_from_send_s'], 12)}{secs(r['last_send_s'], 13)}{secs(r['send_spread_s'], 15)}"
        )
    print(f"burst admitted p99 / capacity p99: {ratio:.2f} (from the request send: {ratio_from_send:.2f})")
    hw = hardware()
    out = args.out or os.path.join(
        RESULTS, f"overload_{args.label or 'server'}_{hw.get('gpu', 'cpu').replace(' ', '-')}.json"
    )
    run = {
        "args": vars(args),
        "phases": phases,
        "burst_p99_over_capacity_p99": ratio,
        "burst_p99_over_capacity_p99_from_send": ratio_from_send,
    }
    runs = []
    if args.append and os.path.exists(out):
        with open(out) as f:
            runs = json.load(f)["runs"]
    with open(out, "w") as f:
        json.dump({"hardware": hw, "runs": runs + [run]}, f, indent=2)
    print(f"wrote {out} ({len(runs) + 1} runs)")


if __name__ == "__main__":
    main()
