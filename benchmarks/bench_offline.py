"""Offline throughput of one Engine: N prompts submitted at once, run to completion.

Workloads (token ids drawn with a fixed seed, outputs of fixed length via ignore_eos):
  random         --num-prompts prompts of --input-len tokens
  shared-prefix  --num-groups groups × --prompts-per-group prompts; each group shares a
                 --prefix-len token prefix, each prompt adds a --suffix-len token suffix; shuffled

The same workload runs twice in one process: with the radix cache, and with
`disable_radix_cache=True` as the baseline. Prints a table and writes JSON to
benchmarks/results/ naming the hardware.

  python benchmarks/bench_offline.py --workload shared-prefix --num-groups 8 --prompts-per-group 8 \
      --prefix-len 512 --suffix-len 32 --output-len 32
  python benchmarks/bench_offline.py --config benchmarks/configs/llama-3.1-8b.json --workload random \
      --num-prompts 1000 --input-len 1024 --output-len 256          # dummy weights, no tokenizer (GPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def result_path(out: Optional[str], prefix: str, hw: Dict[str, str]) -> str:
    """`out`, else benchmarks/results/<prefix>_<GPU name or "cpu">.json (the folder is created)."""
    os.makedirs(RESULTS, exist_ok=True)
    return out or os.path.join(RESULTS, f"{prefix}_{(hw.get('gpu') or 'cpu').replace(' ', '-')}.json")


def hardware() -> Dict[str, str]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": str(os.cpu_count())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def make_workload(args, vocab_size: int) -> List[List[int]]:
    rng = random.Random(args.seed)
    low = 100  # skip special / control tokens at the start of the vocabulary

    def ids(n: int) -> List[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    if args.workload == "random":
        return [ids(args.input_len) for _ in range(args.num_prompts)]
    prompts = []
    for _ in range(args.num_groups):
        prefix = ids(args.prefix_len)
        prompts += [prefix + ids(args.suffix_len) for _ in range(args.prompts_per_group)]
    rng.shuffle(prompts)
    return prompts


def run_once(
    engine_kwargs: Dict, prompts: List[List[int]], output_len: int, warmup: bool = True, temperature: float = 0.0
) -> Dict:
    from engine import Engine

    with Engine(**engine_kwargs) as engine:
        params = dict(temperature=temperature, max_new_tokens=output_len, ignore_eos=True)
        if warmup:
            engine.generate([prompts[0][:16]], dict(params, max_new_tokens=2))
            engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        stats = engine.stats()
        backend = engine.runner.attn_backend_name
        graphs = engine.runner.graph_runner is not None
    del engine  # unbind the `with` target, then collect the engine's reference cycles: its GPU memory
    gc.collect()  # goes back before the next run (in this process) sizes its KV pool from free memory
    n_in = sum(len(p) for p in prompts)
    n_out = sum(o.completion_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs)
    return dict(
        elapsed_s=elapsed,
        requests_per_s=len(prompts) / elapsed,
        input_tok_per_s=n_in / elapsed,
        output_tok_per_s=n_out / elapsed,
        total_tok_per_s=(n_in + n_out) / elapsed,
        cache_hit_rate=cached / n_in,
        input_tokens=n_in,
        output_tokens=n_out,
        retractions=stats.retractions,
        kv_total_tokens=stats.kv_total_tokens,
        attention_backend=backend,
        cuda_graphs=graphs,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument(
        "--config",
        default=None,
        help="a config.json of a real architecture: dummy weights, no tokenizer (overrides --model)",
    )
    p.add_argument("--workload", choices=["random", "shared-prefix"], default="shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; the vLLM peer (peer_vllm_bench.py) samples at 1.0"
    )
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without the radix cache")
    p.add_argument("--baseline-only", action="store_true", help="only the run without the radix cache")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/offline_<...>.json)")
    args = p.parse_args()
    extra = {}
    if args.config:
        folder = tempfile.mkdtemp(prefix="bench-model-")
        shutil.copy(args.config, os.path.join(folder, "config.json"))
        args.model, args.load_format, extra = folder, "dummy", dict(skip_tokenizer_init=True)

    engine_kwargs = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size,
        max_prefill_tokens=args.max_prefill_tokens,
        mem_fraction_static=args.mem_fraction_static,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        **extra,
    )
    from engine.models.loader import load_config
    from engine.models.source import resolve_model

    vocab = int(load_config(resolve_model(args.model)).vocab_size)
    prompts = make_workload(args, vocab)
    runs = {}
    if not args.baseline_only:
        runs["radix_cache"] = run_once(engine_kwargs, prompts, args.output_len, temperature=args.temperature)
    if not args.no_baseline:
        runs["no_cache (baseline)"] = run_once(
            dict(engine_kwargs, disable_radix_cache=True), prompts, args.output_len, temperature=args.temperature
        )
    hw = hardware()
    print(
        f"\n{args.workload}: {len(prompts)} prompts, {args.output_len} output tokens each; {hw.get('gpu', hw['cpu'])}"
    )
    cols = ["requests_per_s", "input_tok_per_s", "output_tok_per_s", "total_tok_per_s", "cache_hit_rate", "elapsed_s"]
    print(f"{'run':<22}" + "".join(f"{c:>18}" for c in cols))
    for name, r in runs.items():
        print(f"{name:<22}" + "".join(f"{r[c]:>18.3f}" for c in cols))
    speedup = None
    if len(runs) == 2:
        speedup = runs["radix_cache"]["total_tok_per_s"] / runs["no_cache (baseline)"]["total_tok_per_s"]
        print(f"speedup from the radix cache: {speedup:.2f}x")

    out = result_path(args.out, f"offline_{args.workload}", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_offline",
                args=vars(args),
                hardware=hw,
                runs=runs,
                radix_speedup=speedup,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
