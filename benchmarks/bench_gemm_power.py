"""Prefill-sized matmuls under the GPU's power limit: throughput, SM clock and power draw, by operand values.

A prefill or mixed step of ~2,048 tokens spends most of its time in matmuls of M = --tokens rows by the
weights of one decoder layer (qkv, o, gate_up and down of --config). This script runs those four products
back to back for --seconds per case and samples the SM clock and the board power with `nvidia-smi` every
100 ms meanwhile. The cases differ only in the operands' values:

  engine     weights N(0, initializer_range), activations N(0, 1): radixserve's dummy weights
  vllm       weights and activations uniform in [-1e-3, 1e-3]: vLLM's dummy weights
  zeros      all zero: the baseline of the same kernels with (almost) no switching power

Where the GPU draws its power limit, the clock falls until the draw fits, and a matmul's time follows the
clock: the numbers say how far the bf16 products of a step are from their throughput at the full clock.
Each case runs twice, interleaved.

  python benchmarks/bench_gemm_power.py [--tokens 2048] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = ("engine", "vllm", "zeros")


def layer_shapes(cfg: Dict) -> Dict[str, Tuple[int, int]]:
    """name -> (N, K) of one decoder layer's weights (qkv, o, gate_up, down)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    q = cfg["num_attention_heads"] * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def operands(case: str, shapes: Dict[str, Tuple[int, int]], tokens: int, std: float, seed: int):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def fill(shape, scale):
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        if case == "engine":
            return t.normal_(0.0, scale, generator=gen)
        if case == "vllm":
            return t.uniform_(-1e-3, 1e-3, generator=gen)
        return t.zero_()

    weights = {name: fill((n, k), std) for name, (n, k) in shapes.items()}
    inputs = {name: fill((tokens, k), 1.0) for name, (n, k) in shapes.items()}
    return weights, inputs


def sample_file(path: str) -> List[Tuple[float, float, float]]:
    """(unix time, SM clock MHz, power W) rows of an `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw`
    log."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((t, float(parts[1].split()[0]), float(parts[2].split()[0])))
            except (ValueError, IndexError):
                continue
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-3.1-8b.json")
    )
    p.add_argument("--tokens", type=int, default=2048, help="rows of every product (prompt tokens of a step)")
    p.add_argument("--seconds", type=float, default=6.0, help="run time of each case")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/gemm-power_<gpu>.json)")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("bench_gemm_power needs a CUDA device")
    from bench_offline import hardware, result_path

    with open(args.config) as f:
        cfg = json.load(f)
    shapes = layer_shapes(cfg)
    std = float(cfg.get("initializer_range", 0.02))
    flops = sum(2 * args.tokens * n * k for n, k in shapes.values())
    log = tempfile.NamedTemporaryFile(prefix="gemm-power-", suffix=".csv", delete=False).name
    query = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,power.limit", "--format=csv,noheader"]
    limit = subprocess.run(query, capture_output=True, text=True).stdout.strip().split(",")[-1].strip()
    with open(log, "w") as sink:  # the sampler keeps its own copy of the descriptor
        sampler = subprocess.Popen([*query, "-lms", "100"], stdout=sink)
    rows: List[Dict] = []
    try:
        for case in CASES * 2:
            weights, inputs = operands(case, shapes, args.tokens, std, seed=len(rows))
            for _ in range(10):
                for name in shapes:
                    F.linear(inputs[name], weights[name])
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.time()
            start.record()
            rounds = 0
            while time.time() - t0 < args.seconds:
                for _ in range(20):
                    for name in shapes:
                        F.linear(inputs[name], weights[name])
                rounds += 20
                torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            sec = start.elapsed_time(end) / 1e3
            rows.append(dict(case=case, tflops=flops * rounds / sec / 1e12, t_start=t0, t_end=time.time()))
            del weights, inputs
            time.sleep(2)
    finally:
        sampler.terminate()
        sampler.wait()
    samples = sample_file(log)
    os.unlink(log)
    for r in rows:  # the first second of each case is the clock settling
        inside = [(c, w) for t, c, w in samples if r["t_start"] + 1 < t < r["t_end"]]
        r["samples"] = len(inside)
        r["sm_clock_mhz"] = sum(c for c, _ in inside) / len(inside) if inside else None
        r["power_w"] = sum(w for _, w in inside) / len(inside) if inside else None

    hw = hardware()
    print(f"\n{args.tokens}-row products of one layer ({', '.join(shapes)}); {hw.get('gpu')}; power limit {limit}")
    print(f"{'case':>8}{'TFLOP/s':>10}{'SM MHz':>9}{'power W':>9}")
    for r in rows:
        clock = f"{r['sm_clock_mhz']:>9.0f}" if r["sm_clock_mhz"] else f"{'-':>9}"
        power = f"{r['power_w']:>9.0f}" if r["power_w"] else f"{'-':>9}"
        print(f"{r['case']:>8}{r['tflops']:>10.1f}{clock}{power}")
    out = result_path(args.out, "gemm-power", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_gemm_power",
                args=vars(args),
                hardware=hw,
                power_limit=limit,
                shapes=shapes,
                results=rows,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
