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

A few rows (2 <= M <= MAX_ROWS, the decode step of a small batch) go to `_rows_kernel`: the same walk over
weight rows (first tile before the PDL wait), with the (M, BLOCK_K) x tile multiplied by the (BLOCK_N,
BLOCK_K) weight tile on tensor cores (`tl.dot`, float32 accumulation; rows padded to 16, the smallest dot),
so each weight byte is read once per step whatever M is. Where the weight has too few rows to keep the GPU
streaming (4096), K is split over SPLIT_K programs; their float32 partials are summed in split order inside
the same kernel by whichever program finishes last (no second kernel, no atomics on the data, so the sums
are deterministic). Each row of x is computed independently of the other rows: a request rounds the same
in any batch of 2..MAX_ROWS, padded or not. Against cuBLAS at these shapes: `benchmarks/bench_gemv.py --rows`.

A program streams only the tiles it has requested: with one tile ahead, an SM has (programs it holds) x (tile
bytes) in flight, which registers per thread bound (`benchmarks/gemv_occupancy.py`). RowsConfig.prefetch = 2
keeps two weight tiles, and x's next tile, in flight while one is multiplied; the tiles are summed in the same
order, so the result is the same bits as with one ahead.

`gemv_silu_mul(x, W)`, W = [gate | up] (2d, K): silu(x @ gate^T) * (x @ up^T), the MLP's gate_up product and
its activation in one launch (GATED). A program keeps the tile that gemv gives the (2d, K) product, but fills
it with gate row p and up row d + p in adjacent columns (`_program_rows`), so every row is summed as gemv sums
it; the epilogue rounds each pair to x's dtype, as gemv does, and applies `fused_layers.silu_mul`, the SiLU
kernel's own arithmetic: the same bits as the two launches, without the second kernel and the (M, 2d)
intermediate.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels.triton import interpreted, pdl
from kernels.triton.fused_layers import silu_mul


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


class RowsConfig(NamedTuple):
    """Tile of `_rows_kernel`: BLOCK_N weight rows per program (>= 16, a dot operand), BLOCK_K per K tile."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    split_k: int = 1  # programs per BLOCK_N rows, each over K / split_k (K must be a multiple of split_k * block_k)
    prefetch: int = 1  # weight tiles loaded ahead of the one being multiplied: 1 or 2 (2 needs >= 2 whole tiles)


MAX_ROWS = 16  # x of up to this many rows takes the rows kernel; larger products are GEMMs (cuBLAS)


@triton.jit
def _program_rows(pid, N, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, row_ok): the BLOCK_N weight rows program `pid` multiplies. Plain: rows pid * BLOCK_N + j. GATED
    (W = [gate | up], N = 2d): BLOCK_N / 2 pairs p = pid * BLOCK_N / 2 + j // 2, gate row p at even j and up
    row d + p at odd j, so that a program's tile has the plain tile's shape (the same sums per row) and its
    result pairs up as (BLOCK_N / 2, 2). Rows past the end read row N - 1 and are not stored."""
    j = tl.arange(0, BLOCK_N)
    if GATED:
        pairs = pid * (BLOCK_N // 2) + j // 2
        rows = tl.where(j % 2 == 0, pairs, pairs + N // 2)
        row_ok = pairs < N // 2
    else:
        rows = pid * BLOCK_N + j
        row_ok = rows < N
    return tl.where(row_ok, rows, N - 1), row_ok


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
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, row_ok = _program_rows(pid, N, GATED, BLOCK_N)
    safe_rows = rows.to(tl.int64)  # rows past N read row N - 1 (loads stay unmasked); their results are not stored
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
    if GATED:
        g, u = tl.split(tl.reshape(y.to(X.dtype.element_ty).to(tl.float32), (BLOCK_N // 2, 2)))
        pairs = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + pairs, silu_mul(g, u, Y), mask=pairs < N // 2)
    else:
        # one rounding to x's dtype (as a matmul in that dtype), then to Y's (float32 logits)
        tl.store(Y + rows, y.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _dot_acc(x, w, acc, DOT: tl.constexpr):
    """acc + x @ w^T in float32, by DOT: "mma" (16-bit operands on tensor cores, float32 accumulation);
    "ieee" (operands widened to float32 and multiplied exactly: float32 inputs, no TF32); "sum" (under Triton's
    interpreter, which has no 16-bit dot and whose float32 dot is a BLAS call whose order of summation may
    differ between columns: an elementwise product summed over K, the same order for every output element).
    16-bit products are exact in float32, so all three give the same sums up to their order within the dot."""
    if DOT == "sum":
        return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if DOT == "ieee":
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _store_rows(
    acc,
    X,
    B,
    Y,
    rows,
    row_ok,
    ms,
    m_ok,
    pid_n,
    N,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Stores a rows-kernel tile's float32 sums acc (BLOCK_M, BLOCK_N) (+ bias), rounded once to x's dtype, then
    to Y's; GATED: silu(gate) * up of the tile's (gate, up) column pairs (`_program_rows`) instead."""
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        g, u = tl.split(tl.reshape(acc.to(X.dtype.element_ty).to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))
        pairs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ok = m_ok[:, None] & (pairs < N // 2)[None, :]
        tl.store(Y + ms[:, None] * stride_ym + pairs[None, :], silu_mul(g, u, Y), mask=ok)
    else:
        ok = m_ok[:, None] & row_ok[None, :]
        tl.store(
            Y + ms[:, None] * stride_ym + rows[None, :], acc.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=ok
        )


@triton.jit
def _rows_kernel(
    X,
    W,
    B,
    Y,
    WS,
    LOCKS,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid // SPLIT_K
    split = pid % SPLIT_K
    k_len = K // SPLIT_K  # SPLIT_K > 1 only where K is a multiple of SPLIT_K * BLOCK_K (the host checks)
    k0 = split * k_len
    rows, row_ok = _program_rows(pid_n, N, GATED, BLOCK_N)
    safe_rows = rows.to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + safe_rows[:, None] * stride_wn + (k0 + cols)[None, :]
    x_ptrs = X + ms[:, None] * stride_xm + (k0 + cols)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=cols[None, :] < k_len, other=0.0, eviction_policy="evict_first")
    if PREFETCH == 2:  # the host sets it only for whole tiles (EVEN_K) and k_len >= 2 * BLOCK_K
        w_ahead = tl.load(w_ptrs + BLOCK_K, eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # everything below may read (or write) what the previous kernel wrote (or read)
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH == 2:
        # Two weight tiles in flight while one is multiplied, and x's tile loaded an iteration before its use
        # (a read of L2 per iteration otherwise waited on); the tiles are summed in the same order as below.
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        for k in range(2 * BLOCK_K, k_len, BLOCK_K):
            w_next = tl.load(w_ptrs + k, eviction_policy="evict_first")
            x_next = tl.load(x_ptrs + (k - BLOCK_K), mask=m_ok[:, None], other=0.0)
            acc = _dot_acc(x, w, acc, DOT)
            w = w_ahead
            w_ahead = w_next
            x = x_next
        acc = _dot_acc(x, w, acc, DOT)
        w = w_ahead
    else:
        for k in range(BLOCK_K, k_len, BLOCK_K):
            if EVEN_K:
                w_next = tl.load(w_ptrs + k, eviction_policy="evict_first")
            else:
                w_next = tl.load(w_ptrs + k, mask=(k + cols[None, :]) < k_len, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs + (k - BLOCK_K), mask=m_ok[:, None], other=0.0)
            acc = _dot_acc(x, w, acc, DOT)
            w = w_next
    last = ((k_len - 1) // BLOCK_K) * BLOCK_K
    x = tl.load(x_ptrs + last, mask=m_ok[:, None] & ((last + cols[None, :]) < k_len), other=0.0)
    acc = _dot_acc(x, w, acc, DOT)
    if SPLIT_K == 1:
        _store_rows(acc, X, B, Y, rows, row_ok, ms, m_ok, pid_n, N, stride_ym, HAS_BIAS, GATED, BLOCK_M, BLOCK_N)
    else:
        # Each split stores its float32 partial; the last of the SPLIT_K programs of these rows to arrive (the
        # lock counts arrivals) sums all partials in split order, so the result does not depend on which
        # program came last, writes y and resets the lock for the next launch.
        tile = (BLOCK_M * BLOCK_N) * (pid_n * SPLIT_K)
        offs = ms[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(WS + tile + split * (BLOCK_M * BLOCK_N) + offs, acc)
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
        arrived = tl.atomic_add(LOCKS + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(WS + tile + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
            _store_rows(total, X, B, Y, rows, row_ok, ms, m_ok, pid_n, N, stride_ym, HAS_BIAS, GATED, BLOCK_M, BLOCK_N)
            tl.atomic_xchg(LOCKS + pid_n, 0)


_INTERPRETED = interpreted(_rows_kernel)


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


@functools.lru_cache(maxsize=None)
def pick_rows_config(n: int, k: int, dtype: torch.dtype) -> RowsConfig:
    """Tile of the rows kernel for an (n, k) weight: a fixed function of the shape (no autotuning).

    From `benchmarks/bench_gemv.py --rows 8 --sweep` on an H100 and an H200 (Llama-3.1-8B's shapes, bf16, PDL
    on; each the best tile or within ~1% of it on the H100, and on the H200 except qkv, whose tile a later H200
    sweep ranks behind others and behind cuBLAS: benchmarks/README.md, "Decode steps and GEMV"), so that enough
    programs stream at once:
      many rows (n >= 16384: gate_up, lm_head): 128 rows per program, 128-element K tiles, 3 stages;
      n > 4096 (qkv): 16 rows, 256-element tiles, 3 stages;
      otherwise (o, down: 4096 rows, only 256 programs of 16 rows): 32 rows and K split in 4 (512
        programs), 128-element tiles, 3 stages.
    Smaller shapes (tests, small models) get tiles that fit them. Cached: it runs on every eager call.
    """
    if n >= 16384:
        block_n, block_k, split = 128, 128, 1
    elif n > 4096:
        block_n, block_k, split = 16, 256, 1
    else:
        block_n, block_k, split = 32, 128, 4
    block_k = max(16, min(block_k * 2 // dtype.itemsize, triton.next_power_of_2(k)))
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    if k % (split * block_k):
        split = 1
    return RowsConfig(block_n, block_k, 4, 3, split)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[GemvConfig | RowsConfig] = None,
) -> torch.Tensor:
    """x (M, K) with M <= MAX_ROWS, or (K,); weight (N, K) with contiguous rows; bias (N,) -> (M, N) (or (N,)).

    The result is rounded to x's dtype, then stored as `out_dtype` (default x's dtype): F.linear(x, w).float()
    in one kernel for float32 logits. One row takes `_gemv_kernel` (tile `config`: a GemvConfig), 2..MAX_ROWS
    rows `_rows_kernel` (a RowsConfig).
    """
    return _launch(x, weight, bias, out_dtype or x.dtype, config, gated=False)


def gemv_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[GemvConfig | RowsConfig] = None,
) -> torch.Tensor:
    """x (M, K) or (K,), weight (2d, K) = [gate | up] rows, bias (2d,) -> (M, d) (or (d,)) in x's dtype:
    silu(x @ gate^T) * (x @ up^T) in one launch, the same bits as fused_layers.silu_and_mul(gemv(x, weight,
    bias)). Each program takes the tile that gemv would give the (2d, K) product, filled with pairs of gate
    and up rows (`_program_rows`), so every row is summed as gemv sums it; the epilogue rounds as gemv then
    silu_and_mul round."""
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_silu_mul: weight has {weight.shape[0]} rows, not [gate | up] of equal halves")
    if config is not None and config.block_n % 2:
        raise ValueError(f"gemv_silu_mul: a tile of {config.block_n} rows cannot hold (gate, up) pairs")
    return _launch(x, weight, bias, x.dtype, config, gated=True)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    config: Optional[GemvConfig | RowsConfig],
    gated: bool,
) -> torch.Tensor:
    """Checks the operands and launches the kernel for x's row count; (M, N) or (M, N / 2) when gated."""
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1) if squeeze else x
    n, k = weight.shape
    if x2.dim() != 2 or x2.shape[1] != k:
        raise ValueError(f"gemv: x has {x2.shape[-1]} columns, weight has {k}")
    m = x2.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv: x has {m} rows; 1 to {MAX_ROWS} are supported")
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight rows must be contiguous")
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    n_out = n // 2 if gated else n
    if m > 1:
        return _gemv_rows(x2, weight, bias, out_dtype, config or pick_rows_config(n, k, weight.dtype), gated)
    cfg = config or pick_config(n, k, weight.dtype)
    y = torch.empty((1, n_out), dtype=out_dtype, device=x.device)
    pairs_or_rows = cfg.block_n // 2 if gated else cfg.block_n
    _gemv_kernel[(triton.cdiv(n_out, pairs_or_rows),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        GATED=gated,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        **pdl.launch_args(x.device),
    )
    return y.view(n_out) if squeeze else y


_LOCKS: dict = {}


def _split_locks(device: torch.device, n_blocks: int) -> torch.Tensor:
    """Arrival counters of split-K launches on `device`, all zero between launches (the last program of each
    row block resets its own). One buffer per device: launches that use it must not run concurrently, as
    the kernels of one stream do not (the engine's forward passes share one stream per device)."""
    key = (device.type, device.index)
    locks = _LOCKS.get(key)
    if locks is None or locks.numel() < n_blocks:
        locks = torch.zeros(max(n_blocks, 1 << 14), dtype=torch.int32, device=device)
        _LOCKS[key] = locks
    return locks


def _dot_mode(dtype: torch.dtype) -> str:
    """`_dot_acc`'s DOT for x of `dtype`: "sum" where the kernel runs under Triton's interpreter (decided when
    it was defined, from TRITON_INTERPRET), else the tensor-core dot, exact in float32 for float32 inputs."""
    if _INTERPRETED:
        return "sum"
    return "ieee" if dtype == torch.float32 else "mma"


def rows_launch(k: int, cfg: RowsConfig) -> Tuple[int, bool, int]:
    """(SPLIT_K, EVEN_K, PREFETCH) with which `_rows_kernel` runs tile `cfg` over K = k: the K split only where
    K divides evenly into split_k * block_k tiles, two tiles ahead only over whole tiles, at least two."""
    split = cfg.split_k if k % (cfg.split_k * cfg.block_k) == 0 else 1
    even_k = (k // split) % cfg.block_k == 0
    ahead = 2 if cfg.prefetch == 2 and even_k and k // split >= 2 * cfg.block_k else 1
    return split, even_k, ahead


def _gemv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    cfg: RowsConfig,
    gated: bool = False,
) -> torch.Tensor:
    """x (M, K) contiguous, 2 <= M <= MAX_ROWS -> (M, N) through `_rows_kernel`; gated: (M, N / 2)."""
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    y = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    n_blocks = triton.cdiv(n_out, cfg.block_n // 2 if gated else cfg.block_n)
    split, even_k, ahead = rows_launch(k, cfg)
    if split > 1:
        workspace = torch.empty(n_blocks * split * block_m * cfg.block_n, dtype=torch.float32, device=x.device)
        locks = _split_locks(x.device, n_blocks)
    else:
        workspace = locks = y  # not read
    _rows_kernel[(n_blocks * split,)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        workspace,
        locks,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=even_k,
        GATED=gated,
        DOT=_dot_mode(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        PREFETCH=ahead,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_args(x.device),
    )
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 matmul, (M, N) (x (K,) is one row), rounded once to x's dtype."""
    y = (x.float().reshape(1, -1) if x.dim() == 1 else x.float()) @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
