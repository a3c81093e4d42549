"""Few-row matmuls of a decode step: radixserve's GEMV kernels and torch's two cuBLAS paths, in the same run.

For every weight shape of one decoder layer and the lm_head of a config (--config), times y = x @ W^T with
x of M rows (--rows, default 1: a batch-1 step; up to MAX_MEDIUM_ROWS), in the ways that apply to M:

  cublas     F.linear on torch's default BLAS path (cuBLAS picks its kernel, split-K included)
  cublaslt   F.linear on torch's cuBLASLt path (engine.models.layers.linear_cublaslt: what the engine runs
             for products of more rows than the GEMV kernels take, up to EngineConfig.cublaslt_max_rows)
  gemv       kernels/triton/gemv.py (one row: _gemv_kernel, more: _rows_kernel), plain launches; M up to
             kernels.triton.gemv.MAX_ROWS
  gemv+pdl   the same with programmatic dependent launch (Hopper and later)
  gemv+pdl+ahead2  2..MAX_ROWS rows: the same tile with two weight tiles loaded ahead (RowsConfig.prefetch 2)
  gemv+silu  gate_up only: the product then fused_layers.silu_and_mul, two launches with PDL (the MLP before
             the gated epilogue)
  gated      gate_up only: gemv_silu_mul, the product and SiLU-and-mul in one launch with PDL (what LlamaMLP runs)

Each variant runs as a CUDA graph of --calls back-to-back products over rotating copies of the weight
(together >= 256 MiB, so no product finds its weight in the 50 MiB L2 as a real step would not), timed with
CUDA events, best of --repeats. Reported: microseconds per product and the weight bytes over that time as a
fraction of the device-to-device copy bandwidth (bytes read + written) measured first in this process, the
denominator of bench_decode's roofline. --sweep also times every tile of a grid for each shape and M (PDL on
and off for one row; on for more, as the engine runs them); the grid's kernels are compiled first by --jobs
processes.

  python benchmarks/bench_gemv.py --config benchmarks/configs/llama-3.1-8b.json [--rows 1 2 4 8 16] [--sweep]
      [--tensor-parallel-size 2]   (one rank's share of each weight)
  python benchmarks/bench_gemv.py --rows 8 --sweep --jobs 15 --weights qkv o
  python benchmarks/bench_gemv.py --rows 32 64        (medium decode batches: the two cuBLAS paths)
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

MAX_MEDIUM_ROWS = 256
"""The most rows --rows takes: the decode batches up to the engine's largest default CUDA graph."""


def decode_shapes(cfg: Dict, tp: int = 1) -> Dict[str, tuple]:
    """name -> (N, K) of every matmul weight a decode step reads once per layer, plus the lm_head, as rank 0
    of a tensor-parallel group of `tp` ranks holds it (engine.parallel.shard)."""
    from engine.parallel.shard import head_shard, split_range, vocab_shard

    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    d = cfg.get("head_dim") or h // hq
    heads = head_shard(hq, hkv, 0, tp)
    start, end = split_range(cfg["intermediate_size"], tp, 0)
    return {
        "qkv": ((heads.num_heads + 2 * heads.num_kv_heads) * d, h),
        "o": (h, heads.num_heads * d),
        "gate_up": (2 * (end - start), h),
        "down": (h, end - start),
        "lm_head": (vocab_shard(cfg["vocab_size"], 0, tp).padded, h),
    }


def sweep_tiles(m: int, n: int, k: int) -> list:
    """The tile grid --sweep times for M rows of an (n, k) weight: GemvConfig (one row) or RowsConfig tuples
    that fit the shape."""
    import triton

    from kernels.triton.gemv import GemvConfig, RowsConfig, rows_launch

    if m == 1:
        return [
            GemvConfig(bn, bk, warps)
            for bn, bk, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8))
            if bn * bk <= 16384
        ]
    # The rows kernel's K loop is not software-pipelined by Triton (its weight loads run ahead by hand), so
    # num_stages does not change its code: one value. What keeps bytes in flight is the tile, the warps that
    # share it (registers per thread decide how many programs an SM holds) and the tiles loaded ahead.
    tiles = [
        RowsConfig(bn, bk, warps, 3, split, prefetch)
        for bn, bk, warps, split, prefetch in itertools.product(
            (16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (1, 2, 4), (1, 2)
        )
    ]
    # whole K tiles in every split, at most 4096 programs, and two ahead only where it launches so
    return [
        c
        for c in tiles
        if k % (c.split_k * c.block_k) == 0
        and triton.cdiv(n, c.block_n) * c.split_k <= 4096
        and rows_launch(k, c)[2] == c.prefetch
    ]


def _compile_tiles(n: int, k: int, m: int, tiles: list) -> int:
    """Run (and so compile into Triton's on-disk cache) gemv for every tile, in a worker process: the timing
    process then finds each kernel compiled. Returns how many tiles could not be built (out of resources)."""
    import torch

    from kernels.triton.gemv import gemv

    w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
    failed = 0
    for c in tiles:
        try:
            gemv(x, w, config=c)
        except Exception:  # noqa: BLE001  (a tile the compiler or the SM cannot hold is skipped by the sweep)
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(jobs: int, work: list) -> None:
    """Compile every (n, k, m, tiles) of `work` in `jobs` spawned processes, the tiles dealt round-robin."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    chunks = [(n, k, m, tiles[i::jobs]) for n, k, m, tiles in work for i in range(jobs) if tiles[i::jobs]]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_compile_tiles, *zip(*chunks)))
    print(f"compiled {sum(len(t) for *_, t in work)} tiles in {jobs} processes ({failed} could not be built)")


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
    return best_seconds_per_call(graph.replay, calls, repeats)


def time_eager(fn: Callable[[int], None], calls: int, repeats: int = 5) -> float:
    """Seconds per call of fn(i), `calls` eager calls in a row; best of `repeats`, after two warm-up rounds."""
    import torch

    def run() -> None:
        for i in range(calls):
            fn(i)

    run()
    run()
    torch.cuda.synchronize()
    return best_seconds_per_call(run, calls, repeats)


def best_seconds_per_call(run: Callable[[], None], calls: int, repeats: int) -> float:
    """The best of `repeats` device timings (CUDA events) of run(), which makes `calls` calls; per call."""
    import torch

    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
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
    p.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1],
        help=f"rows of x (batch sizes), 1 to {MAX_MEDIUM_ROWS}; the GEMV kernels and --sweep up to their MAX_ROWS",
    )
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile shapes per weight and M")
    p.add_argument("--weights", nargs="+", default=None, help="only these weights (qkv o gate_up down lm_head)")
    p.add_argument("--jobs", type=int, default=8, help="--sweep: processes that compile the grid's kernels first")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="the weights as one rank of this many holds them"
    )
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/gemv_<model>_<gpu>.json)")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA device")
    from bench_decode import copy_bandwidth
    from bench_offline import hardware, result_path

    from engine.models.layers import linear_cublaslt
    from kernels.triton import pdl
    from kernels.triton.fused_layers import silu_and_mul
    from kernels.triton.gemv import MAX_ROWS, gemv, gemv_silu_mul, pick_config, pick_rows_config

    if not all(1 <= m <= MAX_MEDIUM_ROWS for m in args.rows):
        sys.exit(f"--rows: 1 to {MAX_MEDIUM_ROWS}")
    if args.sweep and max(args.rows) > MAX_ROWS:
        sys.exit(f"--sweep times the GEMV kernels' tiles: --rows 1 to {MAX_ROWS}")

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    with open(args.config) as f:
        cfg = json.load(f)
    shapes = decode_shapes(cfg, args.tensor_parallel_size)
    if args.weights:
        unknown = set(args.weights) - set(shapes)
        if unknown:
            sys.exit(f"--weights: unknown {sorted(unknown)}; choose from {list(shapes)}")
        shapes = {name: shape for name, shape in shapes.items() if name in args.weights}
    if args.sweep and args.jobs > 0:
        precompile(args.jobs, [(n, k, m, sweep_tiles(m, n, k)) for n, k in shapes.values() for m in args.rows])
    rows: List[Dict] = []
    sweeps: Dict[str, List[Dict]] = {}
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]

        def run(fn, pdl_on=True):
            pdl.set_enabled(pdl_on)
            try:
                return time_graph(lambda i: fn(ws[i % copies]), args.calls, args.repeats)
            finally:
                pdl.set_enabled(True)

        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            reference = F.linear(x, ws[0]).float()
            row = dict(name=name, m=m, n=n, k=k, weight_mib=nbytes / 2**20)
            row["cublaslt_max_abs_diff_vs_cublas"] = float((linear_cublaslt(x, ws[0]).float() - reference).abs().max())
            variants = [
                ("cublas", lambda w, x=x: F.linear(x, w), True),
                ("cublaslt", lambda w, x=x: linear_cublaslt(x, w), True),
            ]
            if m <= MAX_ROWS:
                config = pick_config(n, k, torch.bfloat16) if m == 1 else pick_rows_config(n, k, torch.bfloat16)
                row["config"] = config._asdict()
                row["max_abs_diff_vs_cublas"] = float((gemv(x, ws[0]).float() - reference).abs().max())
                variants += [
                    ("gemv", lambda w, x=x: gemv(x, w), False),
                    ("gemv+pdl", lambda w, x=x: gemv(x, w), True),
                ]
                if m > 1 and config.prefetch == 1:
                    ahead = config._replace(prefetch=2)
                    variants.append(("gemv+pdl+ahead2", lambda w, x=x, c=ahead: gemv(x, w, config=c), True))
                if name == "gate_up":
                    variants += [
                        ("gemv+silu", lambda w, x=x: silu_and_mul(gemv(x, w)), True),
                        ("gated", lambda w, x=x: gemv_silu_mul(x, w), True),
                    ]
            for label, fn, pdl_on in variants:
                sec = run(fn, pdl_on)
                row[f"{label}_us"] = sec * 1e6
                row[f"{label}_of_copy_bw"] = nbytes / sec / bandwidth
            rows.append(row)
            if args.sweep:
                grid = []
                tiles = sweep_tiles(m, n, k)
                for c in tiles:
                    for pdl_on in (True, False) if m == 1 else (True,):  # steps of 2..16 rows run with PDL
                        try:
                            sec = run(lambda w, c=c, x=x: gemv(x, w, config=c), pdl_on)
                        except Exception:  # noqa: BLE001  (a tile too large for the SM: not a candidate)
                            continue
                        grid.append(dict(c._asdict(), pdl=pdl_on, us=sec * 1e6, of_copy_bw=nbytes / sec / bandwidth))
                grid.sort(key=lambda r: r["us"])
                sweeps[f"{name}_m{m}"] = grid
                print(
                    f"{name} ({n}x{k}) M={m} best tiles: "
                    + "; ".join(
                        " ".join(f"{v}" for key, v in g.items() if key not in ("us", "of_copy_bw"))
                        + f" {g['us']:.1f}us {g['of_copy_bw']:.0%}"
                        for g in grid[:5]
                    )
                )
        ws.clear()  # free this shape's copies before the next shape
        torch.cuda.empty_cache()

    hw = hardware()
    print(
        f"\ndecode-step matmuls, bf16, {os.path.basename(args.config)}; {hw.get('gpu')}; copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s; {args.calls} products per CUDA graph, best of {args.repeats}"
    )
    labels = ("cublas", "cublaslt", "gemv", "gemv+pdl", "gemv+pdl+ahead2", "gemv+silu", "gated")
    us_w = {label: max(13, len(label) + 4) for label in labels}
    bw_w = {label: max(10, len(label) + 1) for label in labels}
    print(
        f"{'weight':>10}{'M':>4}{'N x K':>16}{'MiB':>8}"
        + "".join(f"{label + ' us':>{us_w[label]}}" for label in labels)
        + "".join(f"{label:>{bw_w[label]}}" for label in labels)
    )
    for r in rows:
        us = "".join(
            f"{r[label + '_us']:>{us_w[label]}.1f}" if label + "_us" in r else f"{'-':>{us_w[label]}}"
            for label in labels
        )
        bw = "".join(
            f"{r[label + '_of_copy_bw']:>{bw_w[label]}.0%}" if label + "_of_copy_bw" in r else f"{'-':>{bw_w[label]}}"
            for label in labels
        )
        print(f"{r['name']:>10}{r['m']:>4}{str(r['n']) + ' x ' + str(r['k']):>16}{r['weight_mib']:>8.1f}{us}{bw}")
    model = os.path.splitext(os.path.basename(args.config))[0]
    tp = f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    out = result_path(args.out, f"gemv_{model}{tp}", hw)
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
