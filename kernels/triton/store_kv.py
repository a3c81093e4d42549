"""store_kv: scatter the new tokens' K and V into the KV pool.

    k_buf[loc[t]] = k[t]   and   v_buf[loc[t]] = v[t]      for t in [0, T)

k, v: (T, Hkv, D), any float dtype, last dim contiguous; k_buf, v_buf: (num_slots, Hkv, D) contiguous per slot
row; loc: (T,) int64 (int32 works too). Values are cast to the buffer dtype on store. Slots in `loc` must be
distinct (a repeated slot gets one of the writes, unspecified which).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import pdl


# `loc` is a batch view: one compiled variant for any alignment (kernels/triton/decode_attention.py,
# BATCH_VIEW_ARGS).
@triton.jit(do_not_specialize_on_alignment=["Loc"])
def _store_kv_kernel(
    K,
    V,
    K_buf,
    V_buf,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(
        K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :],
        k.to(K_buf.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
        v.to(V_buf.dtype.element_ty),
        mask=mask,
    )


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k, v ((T, Hkv, D)) into k_buf, v_buf ((num_slots, Hkv, D)) at slots `loc` ((T,) int)."""
    T, hkv, d = k.shape
    if T == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1 and k_buf.shape[1:] == (hkv, d)
    _store_kv_kernel[(T,)](
        k,
        v,
        k_buf,
        v_buf,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        HKV=hkv,
        D=d,
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=4 if hkv * d >= 1024 else 1,
        **pdl.launch_args(k.device),
    )


def store_kv_reference(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Plain-torch equivalent of store_kv (what KVPool.set_kv_buffer does)."""
    k_buf[loc.long()] = k.to(k_buf.dtype)
    v_buf[loc.long()] = v.to(v_buf.dtype)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
