"""Decode attention alone: one call per layer over a paged KV pool, FlashInfer's kernels against ours.

For each (batch size, context) of --shapes, bs requests of `context` KV positions each (Llama-3.1-8B's
heads by default: 32 query heads, 8 KV heads, head_dim 128, bf16) run one decode-attention call per layer
of --layers layers, each layer's KV in its own place so that no call finds its KV in L2. Two KV layouts:

  token-major  the engine's KVPool: (slots, layers, 2, Hkv, D), layer l's K and V strided views
  layer-major  (layers, 2, slots, Hkv, D): each layer's K (and V) one contiguous tensor

and two slot orders (sequential: each request's positions in consecutive slots; shuffled: a random
permutation, as a pool after much churn). Kernels:

  fa2 tc       FlashInfer's BatchDecodeWithPagedKVCacheWrapper, tensor cores (the prefill kernel)
  fa2          the same without tensor cores (its CUDA-core decode kernel)
  fa3          the same with backend="fa3" (Hopper)
  triton       kernels/triton/decode_attention.py with the engine's split heuristic

Each variant is timed as a CUDA graph of the --layers calls (bench_gemv.time_graph), best of 5. Reported:
microseconds per call and the KV bytes over that time as a fraction of the device-to-device copy bandwidth
(bytes read + written) measured first in this process.

--sweep times only our kernel, token-major layout and sequential slots, over every launch shape
(BLOCK_N, warps, pipeline stages) and split count, and prints the best of each shape beside the engine's
choice (`pick_num_kv_splits`, `default_kernel_config`); the best few are timed again on shuffled slots.

  python benchmarks/bench_decode_attention.py [--shapes 64x1152 32x640 8x1152] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KERNELS = ("fa2 tc", "fa2", "fa3", "triton")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["64x1152", "32x640", "8x1152"], help="BATCHxCONTEXT")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/decode-attention_<gpu>.json)")
    p.add_argument("--sweep", action="store_true", help="our kernel only, every launch shape and split count")
    args = p.parse_args()
    if args.sweep:
        return sweep(args)

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention needs a CUDA device")
    import flashinfer
    from bench_decode import copy_bandwidth
    from bench_gemv import time_graph
    from bench_offline import hardware, result_path

    from kernels.triton.decode_attention import alloc_decode_scratch, decode_attention, pick_num_kv_splits

    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    n_layers, hq, hkv, d = args.layers, args.num_heads, args.num_kv_heads, args.head_dim
    rows: List[Dict] = []
    for shape in args.shapes:
        bs, ctx = (int(v) for v in shape.split("x"))
        slots_total = bs * ctx + 1  # slot 0 unused, as in the engine's pool
        token_major = torch.randn((slots_total, n_layers, 2, hkv, d), dtype=torch.bfloat16, device=dev)
        layer_major = torch.randn((n_layers, 2, slots_total, hkv, d), dtype=torch.bfloat16, device=dev)
        layouts = {
            "token-major": [(token_major[:, i, 0], token_major[:, i, 1]) for i in range(n_layers)],
            "layer-major": [(layer_major[i, 0], layer_major[i, 1]) for i in range(n_layers)],
        }
        kv_bytes = bs * ctx * hkv * d * 2 * 2  # K and V of one layer
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device=dev)
        for order in ("sequential", "shuffled"):
            slots = torch.arange(1, slots_total, device=dev, dtype=torch.int32)
            if order == "shuffled":
                slots = slots[torch.randperm(slots.numel(), device=dev)]
            indptr = torch.arange(bs + 1, dtype=torch.int32) * ctx
            req_to_token = slots.view(bs, ctx).contiguous()
            seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
            rows_idx = torch.arange(bs, dtype=torch.int32, device=dev)
            for layout, bufs in layouts.items():
                for kernel in KERNELS:
                    if kernel == "triton":
                        splits = pick_num_kv_splits(bs, hkv, ctx, dev)
                        mid_o, mid_lse = alloc_decode_scratch(bs, hq, d, splits, dev)
                        out = torch.empty_like(q)

                        def fn(i, bufs=bufs, splits=splits, mid_o=mid_o, mid_lse=mid_lse, out=out):
                            k, v = bufs[i]
                            return decode_attention(
                                q, k, v, out, req_to_token, rows_idx, seq_lens, d**-0.5, splits, mid_o, mid_lse
                            )
                    else:
                        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
                        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                            workspace, "NHD", use_tensor_cores=kernel != "fa2", backend=kernel.split()[0]
                        )
                        wrapper.plan(
                            indptr,
                            slots,
                            torch.ones(bs, dtype=torch.int32),
                            hq,
                            hkv,
                            d,
                            1,
                            q_data_type=torch.bfloat16,
                            kv_data_type=torch.bfloat16,
                            sm_scale=d**-0.5,
                        )
                        caches = [(k.unsqueeze(1), v.unsqueeze(1)) for k, v in bufs]  # page size 1

                        def fn(i, wrapper=wrapper, caches=caches):
                            return wrapper.run(q, caches[i])

                    sec = time_graph(fn, n_layers, repeats=5)
                    row = dict(bs=bs, ctx=ctx, order=order, layout=layout, kernel=kernel, us=sec * 1e6)
                    row["of_copy_bw"] = kv_bytes / sec / bandwidth
                    rows.append(row)
                    print(f"bs {bs} ctx {ctx} {order} {layout} {kernel}: {row['us']:.1f} us {row['of_copy_bw']:.0%}")
        del token_major, layer_major, layouts
        torch.cuda.empty_cache()

    hw = hardware()
    print(f"\ndecode attention per layer call; {hw.get('gpu')}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'bs':>4}{'ctx':>6}{'slots':>12}{'layout':>13}" + "".join(f"{k:>16}" for k in KERNELS))
    for i in range(0, len(rows), len(KERNELS)):  # one line per (shape, slots, layout): its kernels in order
        r = rows[i]
        cells = "".join(f"{x['us']:>8.1f} us {x['of_copy_bw']:>4.0%}" for x in rows[i : i + len(KERNELS)])
        print(f"{r['bs']:>4}{r['ctx']:>6}{r['order']:>12}{r['layout']:>13}{cells}")
    write_result(result_path(args.out, "decode-attention", hw), "bench_decode_attention", args, hw, bandwidth, rows)


def write_result(
    path: str,
    benchmark: str,
    args: argparse.Namespace,
    hw: Dict,
    bandwidth: Optional[float],
    rows: List[Dict],
    **extra,
) -> None:
    """The JSON record of a run: what ran, on what (`bandwidth`: the copy bandwidth measured, if any), its rows."""
    record = dict(benchmark=benchmark, args=vars(args), hardware=hw, **extra)
    if bandwidth is not None:
        record["copy_gb_per_s"] = bandwidth / 1e9
    with open(path, "w") as f:
        json.dump(dict(record, results=rows), f, indent=1)
    print(f"wrote {path}")


SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (1, 2, 3, 4)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_KEEP = 20


def sweep(args: argparse.Namespace) -> None:
    """Every (config, splits) of our kernel per shape; see the module docstring."""
    import itertools

    import torch
    from bench_decode import copy_bandwidth
    from bench_gemv import time_graph
    from bench_offline import hardware, result_path

    from kernels.triton.decode_attention import (
        DecodeKernelConfig,
        alloc_decode_scratch,
        decode_attention,
        default_kernel_config,
        pick_num_kv_splits,
    )

    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    n_layers, hq, hkv, d = args.layers, args.num_heads, args.num_kv_heads, args.head_dim
    default = default_kernel_config(torch.bfloat16)
    rows: List[Dict] = []
    summary: List[Dict] = []
    for shape in args.shapes:
        bs, ctx = (int(v) for v in shape.split("x"))
        slots_total = bs * ctx + 1
        pool = torch.randn((slots_total, n_layers, 2, hkv, d), dtype=torch.bfloat16, device=dev)
        bufs = [(pool[:, i, 0], pool[:, i, 1]) for i in range(n_layers)]
        kv_bytes = bs * ctx * hkv * d * 2 * 2
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device=dev)
        rows_idx = torch.arange(bs, dtype=torch.int32, device=dev)
        seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        orders = {"sequential": torch.arange(1, slots_total, device=dev, dtype=torch.int32)}
        orders["shuffled"] = orders["sequential"][torch.randperm(slots_total - 1, device=dev)]

        def timed(cfg, splits, order):
            req_to_token = orders[order].view(bs, ctx).contiguous()
            mid_o, mid_lse = alloc_decode_scratch(bs, hq, d, splits, dev)

            def fn(i):
                k, v = bufs[i]
                args_ = (req_to_token, rows_idx, seq_lens, d**-0.5, splits, mid_o, mid_lse)
                return decode_attention(q, k, v, out, *args_, config=cfg)

            try:
                sec = time_graph(fn, n_layers, repeats=3)
            except Exception as exc:  # noqa: BLE001 - a launch shape the device cannot run (shared memory)
                print(f"  skip {cfg} splits {splits}: {type(exc).__name__}")
                return None
            row = dict(bs=bs, ctx=ctx, order=order, splits=splits, us=sec * 1e6, of_copy_bw=kv_bytes / sec / bandwidth)
            row.update(cfg._asdict())
            rows.append(row)
            return row

        engine_splits = pick_num_kv_splits(bs, hkv, 1 << 30, dev)  # a captured graph's split count
        base = timed(default, engine_splits, "sequential")
        found = []
        for bn, w, st in itertools.product(SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES):
            cfg = DecodeKernelConfig(bn, w, st)
            for splits in sorted(set(SWEEP_SPLITS) | {engine_splits}):
                if splits > max(1, -(-ctx // bn)):
                    continue
                row = timed(cfg, splits, "sequential")
                if row is not None:
                    found.append(row)
        found.sort(key=lambda r: r["us"])
        base_shuffled = timed(default, engine_splits, "shuffled")
        best_shuffled = []
        for r in found[:5]:
            cfg = DecodeKernelConfig(r["block_n"], r["num_warps"], r["num_stages"])
            best_shuffled.append(timed(cfg, r["splits"], "shuffled"))
        top = found[0]
        summary.append(
            dict(bs=bs, ctx=ctx, engine=base, best=top, engine_shuffled=base_shuffled, top5_shuffled=best_shuffled)
        )
        print(
            f"bs {bs} ctx {ctx}: engine ({default.block_n},{default.num_warps},{default.num_stages}) splits "
            f"{engine_splits} {base['us']:.1f} us ({base['of_copy_bw']:.0%}); best ({top['block_n']},"
            f"{top['num_warps']},{top['num_stages']}) splits {top['splits']} {top['us']:.1f} us "
            f"({top['of_copy_bw']:.0%})",
            flush=True,
        )
        for r in found[:10]:
            print(f"    ({r['block_n']},{r['num_warps']},{r['num_stages']}) splits {r['splits']}: {r['us']:.1f} us")
        print(
            f"    shuffled: engine {base_shuffled['us']:.1f} us; top 5 "
            + ", ".join(f"{r['us']:.1f}" for r in best_shuffled if r)
        )
        bufs.clear()
        del pool
        torch.cuda.empty_cache()
    kept = []  # the JSON keeps the SWEEP_KEEP fastest of each shape and slot order
    for key in dict.fromkeys((r["bs"], r["ctx"], r["order"]) for r in rows):
        kept += sorted((r for r in rows if (r["bs"], r["ctx"], r["order"]) == key), key=lambda r: r["us"])[:SWEEP_KEEP]
    hw = hardware()
    path = result_path(args.out, "decode-attention-sweep", hw)
    note = f"results: the {SWEEP_KEEP} fastest (launch shape, split count) of each shape and slot order"
    write_result(path, "bench_decode_attention --sweep", args, hw, bandwidth, kept, summary=summary, note=note)


if __name__ == "__main__":
    main()
