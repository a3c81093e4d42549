"""Fused elementwise layers of the decoder, one launch each (the GPU path of engine/models/layers.py).

    rmsnorm(x, w, eps)                  y = w * (x / sqrt(mean(x^2) + eps))              (T, N) -> (T, N)
    fused_add_rmsnorm(x, r, w, eps)     s = x + r; y = rmsnorm(s); returns (y, s)        one pass instead of four
                                        (s into a given residual_out)
    silu_and_mul(x)                     (T, 2d) = [gate | up] -> silu(gate) * up          (T, d)
    rope(q, k, cos, sin)                rotate-half rotary embedding of q (T, H, D) and k (T, Hkv, D) into
                                        new contiguous tensors (or given ones: out), cos/sin (T, D) shared by
                                        all heads

Numerics follow the torch code they replace (Hugging Face's): reductions and products in float32, and the
same roundings to the activation dtype at the same places (the normalized x is rounded before the weight
multiply; the sum x + r is rounded before it is normalized; silu(gate) is rounded before the multiply), so
in float32 the results equal torch's up to the order of the mean's summation. Every kernel takes one row per
program (rows of up to 16K elements fit one block). Inputs may be row-strided views (last dim contiguous).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels.triton import pdl


@triton.jit
def _rmsnorm_kernel(
    X,
    R,
    Y,
    S,
    W,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(S + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (w * normed).to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (T, N) view when possible (last dim contiguous), else a contiguous copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N), weight (N,) -> (..., N) in x's dtype (weight's dtype must match x's)."""
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[1]
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            x2,
            y,
            y,
            weight,
            x2.stride(0),
            0,
            y.stride(0),
            0,
            n,
            eps,
            HAS_RESIDUAL=False,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_warps(n),
            **pdl.launch_args(x.device),
        )
    return y.view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x, residual (T, N) -> (rmsnorm(x + residual), x + residual) in x's dtype: new (T, N) tensors, the sum
    written into `residual_out` instead when given (contiguous (T, N); it may be `residual` itself: each
    program reads its row whole before writing it)."""
    x2, r2 = _rows(x), _rows(residual)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        assert residual_out.is_contiguous() and residual_out.numel() == x2.numel() and residual_out.dtype == x.dtype
        s = residual_out.view(x2.shape)
    n = x2.shape[1]
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            r2,
            y,
            s,
            weight,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            s.stride(0),
            n,
            eps,
            HAS_RESIDUAL=True,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_warps(n),
            **pdl.launch_args(x.device),
        )
    return y.view(x.shape), s.view(x.shape)


@triton.jit
def silu_mul(g, u, Y):
    """silu(g) * u in Y's element type from float32 g, u (values of that type): silu(g) rounded to it before the
    multiply, the product rounded once. Shared by every kernel that applies SiLU-and-mul, so that they round
    alike (kernels/triton/gemv.py applies it in the gate_up product's epilogue)."""
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    return (act * u).to(Y.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, D, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, silu_mul(g, u, Y), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2d) = [gate | up] -> (T, d) = silu(gate) * up, in x's dtype."""
    x2 = _rows(x)
    d = x2.shape[1] // 2
    y = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, y, x2.stride(0), y.stride(0), d, BLOCK=block, num_warps=4, **pdl.launch_args(x.device)
        )
    return y.view(*x.shape[:-1], d)


@triton.jit
def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    H: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c1 = tl.load(COS + t * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_ct + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * stride_st + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    # q: out[:half] = x1 * cos1 - x2 * sin1 ; out[half:] = x2 * cos2 + x1 * sin2 (rotate-half)
    m = (offs_h[:, None] < H) & mask_d[None, :]
    base = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    out = QO + t * (H * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(out, (x1 * c1[None, :] - x2 * s1[None, :]).to(QO.dtype.element_ty), mask=m)
    tl.store(out + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(QO.dtype.element_ty), mask=m)
    m = (offs_h[:, None] < HKV) & mask_d[None, :]
    base = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    out = KO + t * (HKV * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(out, (x1 * c1[None, :] - x2 * s1[None, :]).to(KO.dtype.element_ty), mask=m)
    tl.store(out + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(KO.dtype.element_ty), mask=m)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k (T, Hkv, D) (views allowed, last dim contiguous); cos, sin (T, D) or (T, 1, D).

    Returns rotated (q, k) in q's / k's dtype: new contiguous tensors, or `out` = (q_out, k_out), contiguous
    tensors of those shapes that do not overlap q or k, written and returned.
    """
    T, H, D = q.shape
    hkv = k.shape[1]
    cos2, sin2 = cos.reshape(T, D), sin.reshape(T, D)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos2.stride(-1) == 1 and sin2.stride(-1) == 1
    if out is None:
        qo = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
        ko = torch.empty((T, hkv, D), dtype=k.dtype, device=k.device)
    else:
        qo, ko = out
        assert qo.is_contiguous() and ko.is_contiguous() and qo.shape == q.shape and ko.shape == k.shape
    if T:
        half = D // 2
        _rope_kernel[(T,)](
            q,
            k,
            qo,
            ko,
            cos2,
            sin2,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos2.stride(0),
            sin2.stride(0),
            H=H,
            HKV=hkv,
            HALF=half,
            BLOCK_H=triton.next_power_of_2(max(H, hkv)),
            BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4,
            **pdl.launch_args(q.device),
        )
    return qo, ko


# Req_pool_indices and Seq_lens are batch views: one compiled variant for any alignment
# (kernels/triton/decode_attention.py, BATCH_VIEW_ARGS).
@triton.jit(do_not_specialize_on_alignment=["Req_pool_indices", "Seq_lens"])
def _kv_indices_kernel(Req_to_token, Req_pool_indices, Seq_lens, Indptr, Out, stride_r2t, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    n = tl.load(Seq_lens + b).to(tl.int32)
    dst = tl.load(Indptr + b).to(tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(Req_to_token + row * stride_r2t + offs, mask=mask, other=0)
        tl.store(Out + dst + offs, slots.to(tl.int32), mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Flatten each request's KV slots: out[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], j] for
    j < seq_lens[i]. kv_indptr (bs + 1,) int32 on the device; out (>= kv_indptr[-1],) int32. Returns out."""
    bs = req_pool_indices.shape[0]
    if bs:
        _kv_indices_kernel[(bs,)](
            req_to_token, req_pool_indices, seq_lens, kv_indptr, out, req_to_token.stride(0), BLOCK=512, num_warps=4
        )
    return out


def _warps(n: int) -> int:
    return 1 if n <= 256 else 4 if n <= 2048 else 8


# --- plain-torch references (tests) -------------------------------------------------------------------
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D), cos/sin (T, D) -> rotated, computed in float32, cast to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)
