"""Serving overhead: one worker behind the Ray Serve cluster vs the bare Engine, same prompts.

Both sides send the same prompts (bench_serving's workloads, fixed seed: `random` completions or
`shared-prefix` chats rendered with the model's chat template for the bare side) with the same
sampling (temperature 0, --output-len tokens with ignore_eos) at the same --max-concurrency.

  cluster  bench_serving's streaming client against --base-url (start the cluster yourself:
           `bash deploy/serve.sh workers=1`); nothing is started here
  bare     engine.Engine in this process, Engine.generate_stream under an asyncio semaphore;
           TTFT = first chunk with text, as the HTTP client measures it

--mode cluster / bare / both: each mode stores its side in the --out JSON (keeping the other side
already there), so the cluster can be stopped before the bare run and the machine stays quiet.
When both sides are present it prints the table and the ratios (cluster / bare throughput, added TTFT).

  python benchmarks/bench_overhead.py --mode cluster --base-url http://127.0.0.1:8000
  python benchmarks/bench_overhead.py --mode bare --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving as bs  # noqa: E402
from bench_offline import hardware  # noqa: E402

RESULTS = bs.RESULTS


def run_cluster(args, sessions) -> Dict[str, Any]:
    before = bs.server_cache_counters(args.base_url, None)
    results, duration = asyncio.run(bs.run_load(args, sessions))
    after = bs.server_cache_counters(args.base_url, None)
    return bs.summarize(results, duration, before, after)


def run_bare(args, sessions) -> Dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import Engine

    opts = dict(
        max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunked_prefill_size, **args.engine_options
    )
    t0 = time.perf_counter()
    engine = Engine(**{k: v for k, v in opts.items() if v is not None})
    load_s = time.perf_counter() - t0
    try:
        tok = engine.tokenizer if hasattr(engine, "tokenizer") else None
        prompts: List[Any] = []
        for s in sessions:
            t = s[0]
            if t.prompt is not None:
                prompts.append(t.prompt)
            else:  # chat: render with the chat template, as the ingress does
                if tok is None:
                    raise RuntimeError("engine has no tokenizer attribute for chat prompts")
                prompts.append(list(tok.apply_chat_template(t.messages, add_generation_prompt=True)))
        params = {"temperature": args.temperature, "max_new_tokens": args.output_len, "ignore_eos": args.ignore_eos}
        engine.generate(["warm up"], dict(params, max_new_tokens=2))
        if hasattr(engine, "flush_cache"):
            engine.flush_cache()

        async def main() -> tuple:
            sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
            results: List[bs.Result] = []

            async def one(p) -> None:
                async def go() -> bs.Result:
                    res = bs.Result(ok=False)
                    try:
                        async for ch in engine.generate_stream(p, params):
                            if ch.text:
                                res.add_text(ch.text)
                            if ch.finish_reason is not None:
                                res.prompt_tokens, res.cached_tokens = ch.prompt_tokens, ch.cached_tokens
                                res.output_tokens = ch.completion_tokens
                    except Exception as exc:  # noqa: BLE001
                        res.error = f"{type(exc).__name__}: {exc}"
                        return res
                    return res.finish()

                if sem is None:
                    results.append(await go())
                else:
                    async with sem:
                        results.append(await go())

            start = time.perf_counter()
            await asyncio.gather(*(one(p) for p in prompts))
            return results, time.perf_counter() - start

        results, duration = asyncio.run(main())
    finally:
        engine.shutdown()
    summary = bs.summarize(results, duration, None, None)
    summary["engine_load_s"] = load_s
    summary["torch_threads"] = torch.get_num_threads()
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["cluster", "bare", "both"], default="both")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="bare: torch threads (match the worker's).")
    p.add_argument("--max-total-tokens", type=int, default=None, help="bare: KV pool (match the worker's).")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument(
        "--engine-options",
        type=json.loads,
        default={},
        help="bare: more EngineConfig fields as JSON, the same the cluster's worker got, e.g. "
        '\'{"model": "/path/llama", "load_format": "dummy"}\' (default: the default model).',
    )
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.num_conversations, args.num_turns = 1, 1  # unused by these datasets; make_workload reads args only

    sessions = bs.make_workload(args)
    out = args.out or os.path.join(RESULTS, f"overhead_cluster-1worker-vs-bare_{args.dataset}_cpu.json")
    record: Dict[str, Any] = {}
    if os.path.exists(out):
        with open(out) as f:
            record = json.load(f)
    record.setdefault("runs", {})
    record["args"] = {k: (None if v == math.inf else v) for k, v in vars(args).items() if k != "api_key"}
    record["hardware"] = hardware()
    if args.mode in ("cluster", "both"):
        record["runs"]["cluster"] = run_cluster(args, sessions)
    if args.mode in ("bare", "both"):
        record["runs"]["bare"] = run_bare(args, sessions)

    runs = record["runs"]
    cols = [
        ("request_throughput", "req/s"),
        ("output_throughput_tok_s", "out tok/s"),
        ("total_throughput_tok_s", "total tok/s"),
    ]
    print(
        f"\n{'run':<10}" + "".join(f"{c[1]:>13}" for c in cols) + f"{'TTFT p50':>11}{'TTFT p99':>11}"
        f"{'ITL p50':>10}{'E2E p50':>10}{'ok':>8}"
    )
    for name, s in runs.items():
        print(
            f"{name:<10}"
            + "".join(f"{s[c[0]]:>13.2f}" for c in cols)
            + f"{s['ttft_ms']['p50']:>11.1f}{s['ttft_ms']['p99']:>11.1f}{s['itl_ms']['p50']:>10.1f}"
            f"{s['e2e_ms']['p50']:>10.1f}{s['completed']:>5}/{s['requests']}"
        )
    if "cluster" in runs and "bare" in runs:
        c, b = runs["cluster"], runs["bare"]
        record["ratios"] = {
            "throughput_ratio_cluster_over_bare": c["total_throughput_tok_s"] / b["total_throughput_tok_s"],
            "request_throughput_ratio": c["request_throughput"] / b["request_throughput"],
            "added_ttft_ms_p50": c["ttft_ms"]["p50"] - b["ttft_ms"]["p50"],
            "added_ttft_ms_mean": c["ttft_ms"]["mean"] - b["ttft_ms"]["mean"],
            "added_ttft_ms_p99": c["ttft_ms"]["p99"] - b["ttft_ms"]["p99"],
        }
        for k, v in record["ratios"].items():
            print(f"{k:<40}{v:.3f}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
