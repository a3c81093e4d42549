"""Overlap scheduling on and off: offline throughput of one Engine on the same workload, in one process.

Decode-heavy by default (many short prompts, long outputs), where the CPU's per-step work (planning,
result processing, detokenizing, stop checks, streaming) is the largest share of a step and overlap
scheduling hides it behind the device. Greedy outputs of both runs are compared (they must be equal).
Prints a table and writes JSON to benchmarks/results/ naming the hardware.

  python benchmarks/bench_overlap.py --num-prompts 64 --input-len 64 --output-len 256
  python benchmarks/bench_overlap.py --config benchmarks/configs/llama-3.1-8b.json   # dummy weights (GPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_offline import hardware, result_path  # noqa: E402


def run(engine_kwargs: Dict, prompts: List[List[int]], output_len: int, repeats: int) -> Dict:
    """Best of `repeats` timed runs (after a warm-up) on one engine; the token ids of the last run."""
    from engine import Engine

    with Engine(**engine_kwargs) as engine:
        params = dict(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
        engine.generate(prompts[:4], dict(params, max_new_tokens=8))
        times = []
        for _ in range(repeats):
            engine.flush_cache()
            steps = engine.stats().decode_steps
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            times.append(time.perf_counter() - start)
        steps = engine.stats().decode_steps - steps  # of the last run (overlap: its extra step may be pending)
    del engine
    gc.collect()
    best = min(times)
    n_out = sum(o.completion_tokens for o in outs)
    return dict(
        elapsed_s=best,
        output_tok_per_s=n_out / best,
        all_elapsed_s=times,
        decode_steps=steps,
        token_ids=[o.token_ids for o in outs],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--config", default=None, help="an HF config.json: dummy weights of that architecture")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/overlap_<...>.json)")
    args = p.parse_args()
    kwargs = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
    )
    if args.config:
        folder = tempfile.mkdtemp(prefix="bench-model-")
        shutil.copy(args.config, os.path.join(folder, "config.json"))
        kwargs.update(model=folder, load_format="dummy", skip_tokenizer_init=True)
    if kwargs["device"] == "cpu" or (kwargs["device"] == "auto" and not _has_cuda()):
        kwargs["max_total_tokens"] = 65536
    from engine.models.loader import load_config
    from engine.models.source import resolve_model
    import random

    vocab = int(load_config(resolve_model(kwargs["model"])).vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    runs = {
        "overlap": run(kwargs, prompts, args.output_len, args.repeats),
        "no overlap (baseline)": run(
            dict(kwargs, disable_overlap_schedule=True), prompts, args.output_len, args.repeats
        ),
    }
    same = runs["overlap"].pop("token_ids") == runs["no overlap (baseline)"].pop("token_ids")
    hw = hardware()
    print(
        f"\n{len(prompts)} prompts of {args.input_len} tokens, {args.output_len} output tokens each; "
        f"{hw.get('gpu', hw['cpu'])}"
    )
    print(f"{'run':<24}{'output_tok_per_s':>18}{'elapsed_s':>12}{'decode_steps':>14}")
    for name, r in runs.items():
        print(f"{name:<24}{r['output_tok_per_s']:>18.1f}{r['elapsed_s']:>12.3f}{r['decode_steps']:>14}")
    speedup = runs["overlap"]["output_tok_per_s"] / runs["no overlap (baseline)"]["output_tok_per_s"]
    print(f"speedup from overlap scheduling: {speedup:.3f}x; greedy outputs identical: {same}")
    out = result_path(args.out, "overlap", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_overlap",
                args=vars(args),
                hardware=hw,
                runs=runs,
                speedup=speedup,
                outputs_identical=same,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")
    if not same:
        sys.exit("greedy outputs differ between overlap on and off")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
