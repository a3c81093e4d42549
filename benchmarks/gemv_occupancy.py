"""What the GEMV kernels' tiles cost an SM, compiled for a GPU target without a GPU (Triton's bundled ptxas).

For every weight a decode step reads (bench_gemv.decode_shapes of --config) and each x of M rows (--rows),
compiles the kernel the engine launches (M = 1: `_gemv_kernel` with pick_config's tile; 2..MAX_ROWS:
`_rows_kernel` with pick_rows_config's, once per --prefetch; gate_up: their gated form, `gemv_silu_mul`),
specialized as Triton specializes it at run time (pointers 16-byte aligned, sizes and strides divisible by 16),
and reports:

  regs      registers per thread (cuobjdump of the cubin); stack: bytes of local memory per thread (spills)
  smem      shared memory per program (layout conversions of the dot operands)
  per SM    programs an SM holds at once, the least of what registers, shared memory and warps allow
  waves     the launch's programs over (SMs x programs per SM): above 1, a second partial wave
  in flight weight bytes each SM has requested and not yet received: programs resident x tiles loaded ahead
            x tile bytes. A memory stream keeps the bandwidth busy only with about bandwidth x latency bytes in
            flight (Little's law), ~33 KiB per SM for 4.3 TB/s over 132 SMs at ~1 us.

No timing: bench_gemv.py measures the tiles on a GPU; this explains what it measures.

  python benchmarks/gemv_occupancy.py [--rows 1 8 16] [--prefetch 1 2] [--arch 90] [--sms 132]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Per-SM limits of compute capability 9.0 (Hopper): register file, shared memory, resident warps and programs.
SM90 = dict(registers=65536, smem_bytes=233472, warps=64, programs=32)


def programs_per_sm(regs: int, warps: int, smem: int, limits: Dict[str, int] = SM90) -> int:
    """Programs (CTAs) of `warps` warps, `regs` registers per thread and `smem` bytes of shared memory that
    one SM holds at once. Registers are allocated per warp in units of 256; each CTA reserves 1 KiB of
    shared memory for the system."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = (limits["registers"] // regs_per_warp) // warps
    by_smem = limits["smem_bytes"] // (smem + 1024)
    return max(0, min(by_regs, by_smem, limits["warps"] // warps, limits["programs"]))


def _resources(cubin: bytes) -> Dict[str, int]:
    """registers per thread and stack bytes of the one kernel in `cubin` (cuobjdump -res-usage)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {key: int(re.search(rf"{key.upper()}:(\d+)", out).group(1)) for key in ("reg", "stack")}


def compile_tile(m: int, n: int, k: int, config, arch: int, gated: bool = False) -> Dict[str, int]:
    """Compile the kernel `gemv` runs for x (m, k) @ W (n, k)^T in bf16 with `config` (a GemvConfig for m = 1,
    a RowsConfig above) for sm_`arch`, PDL on (gated: `gemv_silu_mul`'s, W = [gate | up]); returns regs, stack,
    smem and the launch's programs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton.gemv import _gemv_kernel, _rows_kernel, rows_launch

    if m == 1:
        kernel, pointers, ints = _gemv_kernel, ("X", "W", "B", "Y"), ("N", "K", "stride_wn")
        constexprs = dict(HAS_BIAS=False, EVEN_K=k % config.block_k == 0, GATED=gated, BLOCK_N=config.block_n)
        constexprs.update(BLOCK_K=config.block_k, USE_PDL=True)
        programs, stages = triton.cdiv(n, config.block_n), 1
    else:
        kernel = _rows_kernel
        pointers = ("X", "W", "B", "Y", "WS", "LOCKS")
        ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")
        split, even_k, ahead = rows_launch(k, config)
        constexprs = dict(
            HAS_BIAS=False, EVEN_K=even_k, DOT="mma", GATED=gated, BLOCK_M=max(16, triton.next_power_of_2(m))
        )
        constexprs.update(BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, PREFETCH=ahead, USE_PDL=True)
        programs, stages = triton.cdiv(n, config.block_n) * split, config.num_stages
    types = {"WS": "*fp32", "LOCKS": "*i32"}
    signature = {
        name: "constexpr" if name in constexprs else (types.get(name, "*bf16") if name in pointers else "i32")
        for name in kernel.arg_names
    }
    values = {"M": m, "N": n, "K": k, "stride_xm": k, "stride_wn": k, "stride_ym": n}
    aligned = [
        i for i, name in enumerate(kernel.arg_names) if name in pointers or (name in ints and values[name] % 16 == 0)
    ]
    source = ASTSource(kernel, signature, constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=config.num_warps, num_stages=stages)
    )
    return dict(_resources(compiled.asm["cubin"]), smem=compiled.metadata.shared, programs=programs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-3.1-8b.json")
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="rows of x, 1 to the rows kernel's MAX_ROWS")
    p.add_argument("--prefetch", type=int, nargs="+", default=[1, 2], choices=(1, 2), help="rows kernel: tiles ahead")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (132: H100 SXM, H200)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/gemv-occupancy_<model>.json)")
    args = p.parse_args()

    # Compiled kernels, not the interpreter's (which a CPU test run may have asked for in the environment).
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    from bench_gemv import decode_shapes
    from bench_offline import RESULTS, hardware
    from kernels.triton.gemv import MAX_ROWS, pick_config, pick_rows_config

    if not all(1 <= m <= MAX_ROWS for m in args.rows):
        sys.exit(f"--rows: 1 to {MAX_ROWS}")
    if args.arch != 90:
        sys.exit("--arch: only 90 (the per-SM limits here are Hopper's)")
    with open(args.config) as f:
        shapes = decode_shapes(json.load(f))
    rows: List[Dict] = []
    print(
        f"{'weight':>8}{'M':>4}{'tile':>34}{'regs':>6}{'stack':>7}{'smem':>8}{'per SM':>8}{'waves':>7}{'in flight':>11}"
    )
    for name, (n, k) in shapes.items():
        for m in args.rows:
            configs = (
                [pick_config(n, k, torch.bfloat16)]
                if m == 1
                else [pick_rows_config(n, k, torch.bfloat16)._replace(prefetch=a) for a in args.prefetch]
            )
            for config in configs:
                r = compile_tile(m, n, k, config, args.arch, gated=name == "gate_up")
                per_sm = programs_per_sm(r["reg"], config.num_warps, r["smem"])
                ahead = getattr(config, "prefetch", 1)
                resident = min(per_sm, r["programs"] / args.sms)
                in_flight = resident * ahead * config.block_n * config.block_k * 2
                row = dict(
                    weight=name, m=m, n=n, k=k, config=config._asdict(), gated=name == "gate_up", registers=r["reg"]
                )
                row.update(
                    stack_bytes=r["stack"],
                    smem_bytes=r["smem"],
                    programs=r["programs"],
                    programs_per_sm=per_sm,
                    waves=r["programs"] / (args.sms * per_sm) if per_sm else float("inf"),
                    weight_bytes_in_flight_per_sm=in_flight,
                )
                rows.append(row)
                tile = f"{config.block_n}x{config.block_k} w{config.num_warps}" + (
                    f" split {config.split_k} ahead {ahead}" if m > 1 else ""
                )
                print(
                    f"{name:>8}{m:>4}{tile:>34}{r['reg']:>6}{r['stack']:>7}{r['smem']:>8}{per_sm:>8}"
                    f"{row['waves']:>7.2f}{in_flight / 1024:>9.1f} K"
                )
    model = os.path.splitext(os.path.basename(args.config))[0]
    os.makedirs(RESULTS, exist_ok=True)
    out = args.out or os.path.join(RESULTS, f"gemv-occupancy_{model}.json")
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="gemv_occupancy",
                args=vars(args),
                hardware=dict(hardware(), triton=triton.__version__, target=f"sm_{args.arch}", sms=args.sms),
                limits=SM90,
                model=model,
                results=rows,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
