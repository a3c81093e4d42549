"""One-row matmuls of a batch-1 decode step: radixserve's GEMV kernel against cuBLAS, in the same run.

For every weight shape of one decoder layer and the lm_head of a config (--config), times y = x @ W^T with
x of one row, three ways:

  cublas     F.linear (cuBLAS picks its kernel, split-K included)
  gemv       kernels/triton/gemv.py, plain launches
  gemv+pdl   the same with programmatic dependent launch (Hopper and later)

Each variant runs as a CUDA graph of --calls back-to-back products over rotating copies of the weight
(together >= 256 MiB, so no product finds its weight in the 50 MiB L2 as a real step would not), timed with
CUDA events, best of --repeats. Reported: microseconds per product and the weight bytes over that time as a
fraction of the device-to-device copy bandwidth (bytes read + written) measured first in this process, the
denominator of bench_decode's roofline. --sweep also times every tile of a grid for each shape.

  python benchmarks/bench_gemv.py --config benchmarks/configs/llama-3.1-8b.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def decode_shapes(cfg: Dict) -> Dict[str, tuple]:
    """name -> (N, K) of every matmul weight a decode step reads once per layer, plus the lm_head."""
    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    d = cfg.get("head_dim") or h // hq
    inter = cfg["intermediate_size"]
    return {
        "qkv": ((hq + 2 * hkv) * d, h),
        "o": (h, hq * d),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (cfg["vocab_size"], h),
    }


def time_graph(fn: Callable[[int], None], calls: int, repeats: int) -> float:
    """Seconds per call of fn(i) (i = call index), as a captured CUDA graph of `calls` calls; best of `repeats`."""
    import torch

    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-3.1-8b.json")
    )
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile shapes per weight")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/gemv_<model>_<gpu>.json)")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA device")
    from bench_decode import copy_bandwidth
    from bench_offline import hardware, result_path

    from kernels.triton import pdl
    from kernels.triton.gemv import GemvConfig, gemv, pick_config

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    with open(args.config) as f:
        cfg = json.load(f)
    rows: List[Dict] = []
    sweeps: Dict[str, List[Dict]] = {}
    for name, (n, k) in decode_shapes(cfg).items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)

        def run(fn, pdl_on=True):
            pdl.set_enabled(pdl_on)
            try:
                return time_graph(lambda i: fn(ws[i % copies]), args.calls, args.repeats)
            finally:
                pdl.set_enabled(True)

        row = dict(name=name, n=n, k=k, weight_mib=nbytes / 2**20, config=pick_config(n, k, torch.bfloat16)._asdict())
        for label, fn, pdl_on in (
            ("cublas", lambda w: F.linear(x, w), True),
            ("gemv", lambda w: gemv(x, w), False),
            ("gemv+pdl", lambda w: gemv(x, w), True),
        ):
            sec = run(fn, pdl_on)
            row[f"{label}_us"] = sec * 1e6
            row[f"{label}_of_copy_bw"] = nbytes / sec / bandwidth
        y = gemv(x, ws[0])
        row["max_abs_diff_vs_cublas"] = float((y.float() - F.linear(x, ws[0]).float()).abs().max())
        rows.append(row)
        if args.sweep:
            grid = []
            for bn, bk, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8)):
                if bn * bk > 16384:
                    continue
                c = GemvConfig(bn, bk, warps)
                sec = run(lambda w, c=c: gemv(x, w, config=c), True)
                grid.append(
                    dict(block_n=bn, block_k=bk, num_warps=warps, us=sec * 1e6, of_copy_bw=nbytes / sec / bandwidth)
                )
            grid.sort(key=lambda r: r["us"])
            sweeps[name] = grid
            print(
                f"{name} ({n}x{k}) best tiles: "
                + "; ".join(
                    f"{g['block_n']}x{g['block_k']} w{g['num_warps']} {g['us']:.1f}us {g['of_copy_bw']:.0%}"
                    for g in grid[:5]
                )
            )
        ws.clear()  # free this shape's copies before the next shape
        torch.cuda.empty_cache()

    hw = hardware()
    print(
        f"\none-row matmuls, bf16, {os.path.basename(args.config)}; {hw.get('gpu')}; copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s; {args.calls} products per CUDA graph, best of {args.repeats}"
    )
    print(
        f"{'weight':>10}{'N x K':>16}{'MiB':>8}{'cublas us':>11}{'gemv us':>10}{'+pdl us':>10}"
        f"{'cublas':>9}{'gemv':>8}{'+pdl':>8}"
    )
    for r in rows:
        print(
            f"{r['name']:>10}{str(r['n']) + ' x ' + str(r['k']):>16}{r['weight_mib']:>8.1f}{r['cublas_us']:>11.1f}"
            f"{r['gemv_us']:>10.1f}{r['gemv+pdl_us']:>10.1f}{r['cublas_of_copy_bw']:>9.0%}"
            f"{r['gemv_of_copy_bw']:>8.0%}{r['gemv+pdl_of_copy_bw']:>8.0%}"
        )
    model = os.path.splitext(os.path.basename(args.config))[0]
    out = result_path(args.out, f"gemv_{model}", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_gemv",
                args=vars(args),
                hardware=hw,
                model=model,
                copy_gb_per_s=bandwidth / 1e9,
                results=rows,
                sweeps=sweeps,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
