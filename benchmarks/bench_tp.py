"""Tensor parallelism on one host: batch-1 decode, greedy agreement and offline throughput per TP size.

For each size in --tp-sizes, in a fresh process (torch.distributed holds one group per process), an Engine
with `tensor_parallel_size` = size on a config.json with dummy weights (the same weights at every size:
the shards put together are the TP=1 tensors) measures:

  tpot_ms         batch-1 time per output token, as the vLLM peer benchmark measures it: one fresh prompt
                  of --tpot-input-len random tokens, generated once for 1 token and once for
                  --tpot-output-len tokens; (t[out] - t[1]) / (out - 1), median of --tpot-trials
  agreement       greedy tokens of --agree-prompts random prompts (--agree-output-len tokens each) compared
                  with the first size's, position by position (bf16 row-parallel sums round differently from
                  one GEMM, so near-ties may part); first_divergence per prompt
  profile         with --profile: rank 0's GPU kernels over one batch-1 generation of --tpot-output-len
                  tokens (torch.profiler), microseconds per output token by kernel, the top ones printed
  throughput      with --num-prompts > 0: the offline random workload of bench_offline.py (prompts of
                  --input-len tokens, --output-len tokens each, ignore_eos, all submitted at once)

  python benchmarks/bench_tp.py --config benchmarks/configs/llama-3.1-8b.json --tp-sizes 1 2 \\
      --control disable_gemv 2:disable_custom_all_reduce
  python benchmarks/bench_tp.py --config benchmarks/configs/llama-3.1-70b.json --tp-sizes 4 \\
      --num-prompts 1000 --input-len 1024 --output-len 256
Prints a table; writes JSON (default benchmarks/results/tp_<config>_<gpu>.json) naming the hardware.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import hardware, result_path  # noqa: E402


def _prompts(n: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def measure(folder: str, tp: int, args_dict: Dict, overrides: Optional[Dict] = None) -> Dict:
    """One TP size, in this (fresh) process, with EngineConfig `overrides`: see the module docstring."""
    from engine import Engine

    args = argparse.Namespace(**args_dict)
    with open(os.path.join(folder, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    kwargs = dict(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        mem_fraction_static=args.mem_fraction_static,
        context_length=args.context_length,
    )
    kwargs.update(overrides or {})
    result: Dict = dict(tensor_parallel_size=tp, overrides=overrides or {})
    start = time.perf_counter()
    with Engine(**kwargs) as engine:
        result["startup_s"] = time.perf_counter() - start
        greedy = dict(temperature=0.0, ignore_eos=True)
        tpot_prompts = iter(_prompts(2 * args.tpot_trials + 2, args.tpot_input_len, vocab, seed=1))

        def timed(max_new: int) -> float:
            t0 = time.perf_counter()
            out = engine.generate(next(tpot_prompts), dict(greedy, max_new_tokens=max_new))
            assert out.completion_tokens == max_new
            return time.perf_counter() - t0

        timed(args.tpot_output_len)  # warm-up
        first = statistics.median(timed(1) for _ in range(args.tpot_trials))
        full = statistics.median(timed(args.tpot_output_len) for _ in range(args.tpot_trials))
        result["tpot_ms"] = (full - first) / (args.tpot_output_len - 1) * 1e3
        if args.profile:
            result["profile_us_per_token"] = _profile(lambda: timed(args.tpot_output_len), args.tpot_output_len)
        agree = _prompts(args.agree_prompts, args.agree_input_len, vocab, seed=2)
        outs = engine.generate(agree, dict(greedy, max_new_tokens=args.agree_output_len))
        result["greedy_tokens"] = [o.token_ids for o in outs]
        if args.num_prompts:
            engine.flush_cache()
            prompts = _prompts(args.num_prompts, args.input_len, vocab, seed=0)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, dict(greedy, max_new_tokens=args.output_len))
            elapsed = time.perf_counter() - t0
            n_out = sum(o.completion_tokens for o in outs)
            result["throughput"] = dict(
                num_prompts=len(prompts),
                input_len=args.input_len,
                output_len=args.output_len,
                elapsed_s=elapsed,
                requests_per_s=len(prompts) / elapsed,
                output_tok_per_s=n_out / elapsed,
                total_tok_per_s=(n_out + len(prompts) * args.input_len) / elapsed,
            )
        stats = engine.stats()
        result["kv_total_tokens"] = stats.kv_total_tokens
        result["kv_leak_free"] = stats.kv_free_tokens + stats.kv_evictable_tokens == stats.kv_total_tokens
    return result


def _profile(generate, tokens: int) -> Dict[str, float]:
    """GPU time of this process's kernels (rank 0's) while `generate()` runs, microseconds per output token by
    kernel name, largest first; "total" is their sum."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
    by_name: Dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            by_name[event.key[:80]] = by_name.get(event.key[:80], 0.0) + event.device_time_total / tokens
    ranked = dict(sorted(by_name.items(), key=lambda kv: -kv[1]))
    return {"total": sum(ranked.values()), **ranked}


def agreement(ref: List[List[int]], other: List[List[int]]) -> Dict:
    same = sum(a == b for ra, rb in zip(ref, other) for a, b in zip(ra, rb))
    first = [next((i for i, (a, b) in enumerate(zip(ra, rb)) if a != b), None) for ra, rb in zip(ref, other)]
    return dict(
        token_agreement=same / sum(len(r) for r in ref),
        identical_prompts=sum(d is None for d in first),
        prompts=len(ref),
        first_divergence=first,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--config", default=os.path.join(here, "configs", "llama-3.1-8b.json"))
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--tpot-input-len", type=int, default=128)
    p.add_argument("--tpot-output-len", type=int, default=256)
    p.add_argument("--tpot-trials", type=int, default=3)
    p.add_argument("--agree-prompts", type=int, default=16)
    p.add_argument("--agree-input-len", type=int, default=64)
    p.add_argument("--agree-output-len", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="rank 0's GPU kernels per output token at batch 1")
    p.add_argument("--num-prompts", type=int, default=0, help="offline throughput prompts (0: skip)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--control",
        nargs="*",
        default=[],
        metavar="FLAG",
        help="boolean EngineConfig fields (e.g. disable_gemv, or 2:disable_custom_all_reduce for TP size 2): one "
        "more run with each set (of the first TP size unless SIZE: is given); with a rounding change alone, its "
        "agreement shows how far greedy tokens move for no other reason",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    folder = tempfile.mkdtemp(prefix="bench-tp-")
    shutil.copy(args.config, os.path.join(folder, "config.json"))
    ctx = multiprocessing.get_context("spawn")
    runs = []
    plan = [(tp, None) for tp in args.tp_sizes]
    for spec in args.control:  # FLAG (the first size) or SIZE:FLAG
        size, _, flag = spec.rpartition(":")
        plan.append((int(size) if size else args.tp_sizes[0], {flag: True}))
    for tp, overrides in plan:
        with ctx.Pool(1) as pool:
            runs.append(pool.apply(measure, (folder, tp, vars(args), overrides)))
    ref = runs[0]
    for run in runs:
        run["agreement_with_first"] = agreement(ref["greedy_tokens"], run["greedy_tokens"])
        run["tpot_ratio_to_first"] = run["tpot_ms"] / ref["tpot_ms"]
    hw = hardware()
    import torch

    hw["gpus"] = str(torch.cuda.device_count())
    print(f"\n{os.path.basename(args.config)} dummy {args.dtype}; {hw.get('gpu')} x {hw['gpus']}")
    print(f"{'TP':>4}{'control':>22}{'TPOT ms':>10}{'ratio':>8}{'agree':>8}{'identical':>11}{'req/s':>9}{'tok/s':>10}")
    for run in runs:
        a, t = run["agreement_with_first"], run.get("throughput") or {}
        print(
            f"{run['tensor_parallel_size']:>4}{','.join(run['overrides']) or '-':>22}"
            f"{run['tpot_ms']:>10.2f}{run['tpot_ratio_to_first']:>8.3f}"
            f"{a['token_agreement']:>8.3f}{a['identical_prompts']:>6}/{a['prompts']:<4}"
            f"{t.get('requests_per_s', float('nan')):>9.2f}{t.get('total_tok_per_s', float('nan')):>10.0f}"
        )
    for run in runs:
        if "profile_us_per_token" in run:
            top = list(run["profile_us_per_token"].items())[:16]
            print(f"\nTP={run['tensor_parallel_size']} {','.join(run['overrides']) or ''}: rank 0 GPU us per token")
            for name, us in top:
                print(f"{us:>10.1f}  {name}")
    name = os.path.splitext(os.path.basename(args.config))[0]
    out = result_path(args.out, f"tp_{name}", hw)
    for run in runs:
        run.pop("greedy_tokens")
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_tp", args=vars(args), hardware=hw, runs=runs, time=time.strftime("%Y-%m-%dT%H:%M:%S%z")
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
