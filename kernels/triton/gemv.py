"""gemv: one row times a weight matrix, y = x @ W^T (+ bias), the matmul of a batch-1 decode step.

    x (1, K), W (N, K) (nn.Linear's layout, rows contiguous), bias (N,) or None -> y (1, N) in x's dtype

A batch-1 decode step is a chain of such products, each reading its whole weight once (the step's time is
the weights' bytes over the memory bandwidth), with short kernels between them. cuBLAS reaches ~90% of the
copy bandwidth on them; what it loses is at the edges of each kernel: the first weight bytes arrive only
after the previous kernel has finished, and split-K configurations add a reduction kernel. This kernel:

  - gives each program BLOCK_N whole rows (no split-K, no second kernel), walking K in BLOCK_K tiles with
    the next tile's load issued before the current tile is multiplied (two tiles in flight per program);
  - with programmatic dependent launch (PDL, Hopper and later, `pdl.enabled`), loads its first weight tile
    *before* waiting for the previous kernel: weights are never written by an earlier kernel, so they may be
    read early; x is read, and y written, only after the wait (no read-after-write or write-after-read race
    with the kernel before). It then lets the next kernel launch, which waits for this one in turn.

Numerics: products and sums in float32, one rounding to x's dtype at the end (as cuBLAS). Each program keeps a
(BLOCK_N, BLOCK_K) float32 accumulator summed over the K tiles and reduces it once at the end, so the
summation order is fixed by (BLOCK_N, BLOCK_K), which `pick_config` derives from (N, K) alone: the same
product is summed the same way in every process and run (no autotuning), graphs on or off.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from kernels.triton import pdl


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # rows past N read row N - 1 (loads stay unmasked in the common case); their results are not stored
    safe_rows = tl.where(row_ok, rows, N - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + safe_rows[:, None] * stride_wn + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=cols[None, :] < K, other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # everything below may read what the previous kernel wrote
        tl.extra.cuda.gdc_launch_dependents()
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w_next = tl.load(w_ptrs + k, eviction_policy="evict_first")
        else:
            w_next = tl.load(w_ptrs + k, mask=(k + cols[None, :]) < K, other=0.0, eviction_policy="evict_first")
        x = tl.load(X + (k - BLOCK_K) + cols)  # tile k - BLOCK_K is a whole tile: it ends at k < K
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = w_next
    last = ((K - 1) // BLOCK_K) * BLOCK_K
    if EVEN_K:
        x = tl.load(X + last + cols)
    else:
        x = tl.load(X + last + cols, mask=(last + cols) < K, other=0.0)
    acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    # one rounding to x's dtype (as a matmul in that dtype), then to Y's (float32 logits)
    tl.store(Y + rows, y.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=row_ok)


@functools.lru_cache(maxsize=None)
def pick_config(n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Tile shape for an (n, k) weight: a fixed function of the shape, so results never depend on timing.

    From `benchmarks/bench_gemv.py --sweep` on an H100 (Llama-3.1-8B's shapes, bf16, PDL on; the best tile
    of each shape within ~1%, 94-105% of the copy bandwidth):
      long rows (k >= 8192, the down projection) or many rows (n >= 16384, gate_up, lm_head): 4 rows per
        program, 2 KiB of each row per tile, so thousands of programs each stream long contiguous runs;
      otherwise (qkv, o) 512-element tiles, 16 rows per program above 4096 rows, else 8 rows and 8 warps
        (the 4096 x 4096 product needs more programs in flight to hide the memory latency).
    Smaller shapes (tests, small models) get tiles that fit them. Cached: it runs on every eager call.
    """
    elem = dtype.itemsize
    if k >= 8192 or n >= 16384:
        block_n, block_k, warps = 4, 2048 // elem, 8 if k >= 8192 else 4
    elif n > 4096:
        block_n, block_k, warps = 16, 1024 // elem, 4
    else:
        block_n, block_k, warps = 8, 1024 // elem, 8 if n * k >= 1 << 22 else 4
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    block_n = min(block_n, max(4, triton.next_power_of_2(n)))
    return GemvConfig(block_n, block_k, warps)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[GemvConfig] = None,
) -> torch.Tensor:
    """x (1, K) or (K,), weight (N, K) with contiguous rows, bias (N,) -> (1, N) (or (N,)).

    The result is rounded to x's dtype, then stored as `out_dtype` (default x's dtype): F.linear(x, w).float()
    in one kernel for float32 logits.
    """
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1)
    n, k = weight.shape
    if x2.shape[1] != k:
        raise ValueError(f"gemv: x has {x2.shape[1]} columns, weight has {k}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight rows must be contiguous")
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    cfg = config or pick_config(n, k, weight.dtype)
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        **pdl.launch_args(x.device),
    )
    return y.view(n) if squeeze else y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 matmul, (1, N), rounded once to x's dtype."""
    y = x.float().reshape(1, -1) @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
