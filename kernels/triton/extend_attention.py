"""Extend (prefill) attention over paged KV: cached prefix + causal new tokens, varlen batch, online softmax.

Request i owns query rows [start_i, start_i + n_i) (start_i = extend_start_loc[i], n_i = extend_seq_lens[i]).
New row r of request i sits at absolute position p_i + r (p_i = extend_prefix_lens[i]) and sees

    cached prefix   positions [0, p_i)       slots req_to_token[req_pool_indices[i], 0:p_i]   (k_buf, v_buf)
    its new tokens  rows [0, r] of its own   k_new[start_i + 0 .. start_i + r]                   (k_new, v_new)

Grid (bs, H, cdiv(max n_i, BLOCK_M)): program (i, h, m) owns rows [m * BLOCK_M, (m + 1) * BLOCK_M) of request
i for query head h (kv head h // G). Phase 1 streams the prefix blocks (no mask but the length), phase 2
the new-token blocks up to the diagonal (causal mask). Programs whose rows start past n_i do nothing.
Logits and softmax statistics are float32; P @ V runs in the KV dtype with float32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.decode_attention import dot_flags, mma

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k, v, s_mask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    s = mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


# The per-request arrays are views into the batch's packed tensor: one compiled variant for any alignment
# (kernels/triton/decode_attention.py, BATCH_VIEW_ARGS).
@triton.jit(do_not_specialize_on_alignment=["Req_pool_indices", "Prefix_lens", "Extend_lens", "Extend_start"])
def _extend_kernel(
    Q,
    K_new,
    V_new,
    O,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_start,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    kvh = h // G
    n_new = tl.load(Extend_lens + b).to(tl.int32)
    prefix = tl.load(Prefix_lens + b).to(tl.int32)
    start = tl.load(Extend_start + b).to(tl.int64)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    active = mblk * BLOCK_M < n_new

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_new
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(
        Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # phase 1: cached prefix [0, prefix), gathered through req_to_token
    prefix_end = tl.where(active, prefix, 0)
    for n0 in range(0, prefix_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix
        slots = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_buf + slots[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_buf + slots[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, PRECISION, UPCAST)

    # phase 2: own new rows [0, min((mblk + 1) * BLOCK_M, n_new)), causal
    new_end = tl.where(active, tl.minimum((mblk + 1) * BLOCK_M, n_new), 0)
    for n0 in range(0, new_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_new
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_new + (start + offs_n)[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v = tl.load(
            V_new + (start + offs_n)[:, None] * stride_vnt + kvh * stride_vnh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        causal = (offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, qk_scale, PRECISION, UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        O + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    scale: float,
) -> torch.Tensor:
    """q (T, H, D), k_new/v_new (T, Hkv, D), k_buf/v_buf (num_slots, Hkv, D) -> out (T, H, D) in place.

    req_to_token (rows, max_ctx) int32; req_pool_indices, prefix_lens, extend_lens, extend_start (bs,) int;
    max_extend_len: max of extend_lens (a host int, sizes the grid).
    """
    T, num_heads, head_dim = q.shape
    bs = extend_lens.shape[0]
    if T == 0 or bs == 0 or max_extend_len == 0:
        return out
    for x in (q, k_new, v_new, out, k_buf, v_buf):
        assert x.stride(-1) == 1
    fp32 = q.dtype == torch.float32
    block_d = triton.next_power_of_2(head_dim)
    if q.device.type != "cuda":
        block_m, block_n, warps = 16, 16, 4  # interpreter: small tiles waste less on short test sequences
    elif fp32 or head_dim > 128:
        block_m, block_n, warps = 32, 32, 4
    else:
        block_m, block_n, warps = 64, 64, 4
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        out,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        scale * _LOG2E,
        G=num_heads // k_buf.shape[1],
        D=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **dot_flags(q.dtype, q.device),
        num_warps=warps,
        num_stages=2,
    )
    return out


def extend_attention_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch, one request at a time, float32 math: dense causal attention over prefix + new tokens."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_buf.shape[1]
    for row, p, n, s in zip(
        req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist(), extend_start.tolist()
    ):
        if n == 0:
            continue
        slots = req_to_token[row, :p].long()
        k = torch.cat([k_buf[slots].float(), k_new[s : s + n].float()]).repeat_interleave(group, dim=1)
        v = torch.cat([v_buf[slots].float(), v_new[s : s + n].float()]).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s : s + n].float(), k) * scale
        visible = torch.arange(p + n, device=q.device)[None, :] <= torch.arange(p, p + n, device=q.device)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[s : s + n] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
