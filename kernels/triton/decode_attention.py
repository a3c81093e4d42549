"""Decode attention over paged KV, split-K ("flash-decoding").

Request i (one query token, q[i]: (H, D)) attends KV positions [0, seq_lens[i]), whose slots are
req_to_token[req_pool_indices[i], 0:seq_lens[i]]. Query head h reads kv head h // G (GQA, H = G * Hkv).

Stage 1, grid (bs, Hkv, num_splits): program (i, g, s) takes the G query heads of kv head g and the
chunk of positions

    [s * C, min((s + 1) * C, seq_len)),    C = round_up(cdiv(seq_len, num_splits), BLOCK_N)

and writes the chunk's normalized partial output and its log-sum-exp (base 2) to float32 scratch
(mid_o (bs, H, num_splits, D), mid_lse (bs, H, num_splits)). Only the first cdiv(seq_len, C) chunks hold
positions; the programs of the others return at once and write nothing.
Stage 2, grid (bs, H): merges those non-empty splits, out = sum_s 2^(lse_s - lse) * o_s. A CUDA graph fixes
num_splits for every context length, so a short context leaves most splits empty: neither stage pays for them.

With one split (large batches: `pick_num_kv_splits`) the whole context is one chunk, and stage 1 writes its
normalized output straight to `out`, rounded once to out's dtype; stage 2 is not launched. Merging a single
split is exact (weight 2^0 = 1, sum of weights 1), so the output is the same bits either way. The choice is a
runtime branch on num_splits, not a constexpr: one compiled kernel serves every split count.

A batch of 1 on a long context thus runs Hkv * num_splits programs instead of Hkv; `pick_num_kv_splits`
chooses num_splits so the whole GPU is busy. Logits and softmax statistics are float32; P @ V runs in the
KV dtype with float32 accumulation.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from kernels.triton import pdl

_LOG2E = 1.4426950408889634
MAX_KV_SPLITS = 64


class DecodeKernelConfig(NamedTuple):
    """Launch shape of stage 1: BLOCK_N KV positions per loop iteration (chunks are rounded up to it, so it
    is part of the summation order), and its warps and software-pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def default_kernel_config(dtype: torch.dtype) -> DecodeKernelConfig:
    """The engine's launch shape (`bench_decode_attention.py --sweep` times the others)."""
    return DecodeKernelConfig(32 if dtype == torch.float32 else 64)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST (set for bf16 under the CPU interpreter, whose dot multiplies
    bf16 bit patterns as integers) computes it in float32 from the same bf16 values."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _chunk_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """C, the positions per split of a context of seq_len: cdiv(seq_len, num_splits) rounded up to BLOCK_N.
    Both stages derive the splits from it, so they agree on which splits hold positions."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


def dot_flags(dtype: torch.dtype, device: torch.device) -> dict:
    """The PRECISION / UPCAST constexprs of `mma` for inputs of `dtype` on `device`."""
    upcast = dtype == torch.bfloat16 and device.type != "cuda"
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


# The split count (and the scratch stride equal to it) varies with the batch: a value of 1 would make Triton
# compile another variant of the kernel (it turns integer arguments equal to 1 into constants) in the middle
# of serving, after the warm-up. One variant serves every split count.
_SPLIT_ARGS = ["num_splits", "stride_ml_h"]
# Per-request arrays are views into the batch's packed tensor (engine/forward_batch.py), or slices of them: whether
# their address is a multiple of 16 bytes changes with the batch, and Triton compiles a variant per alignment.
# Each program loads one element of them, which alignment does not speed up.
BATCH_VIEW_ARGS = ["Req_pool_indices", "Seq_lens"]


@triton.jit(do_not_specialize=_SPLIT_ARGS, do_not_specialize_on_alignment=BATCH_VIEW_ARGS)
def _decode_stage1(
    Q,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_o,
    Mid_lse,
    O,
    stride_qt,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ot,
    stride_oh,
    qk_scale,
    num_splits,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    chunk = _chunk_len(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start >= seq_len:
        return  # an empty chunk: stage 2 reads only the first cdiv(seq_len, chunk) splits

    offs_g = tl.arange(0, BLOCK_H)
    heads = kvh * G + offs_g
    mask_h = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(
        Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    row = tl.load(Req_pool_indices + b).to(tl.int64)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):  # every block holds >= 1 valid position, so m_i turns finite at once
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_buf + slots[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # (BLOCK_H, BLOCK_N), log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slots[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    out = acc / l_i[:, None]  # every chunk here holds >= 1 position: l_i >= 1
    if num_splits == 1:  # the whole context: the output itself (what stage 2 would make of one split)
        tl.store(
            O + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        lse = m_i + tl.log2(l_i)
        tl.store(
            Mid_o + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :],
            out,
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(Mid_lse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=_SPLIT_ARGS, do_not_specialize_on_alignment=BATCH_VIEW_ARGS)
def _decode_stage2(
    Mid_o,
    Mid_lse,
    O,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ot,
    stride_oh,
    Seq_lens,
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    used = tl.cdiv(seq_len, _chunk_len(seq_len, num_splits, BLOCK_N))  # stage 1's non-empty splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, used):
        lse_s = tl.load(Mid_lse + b * stride_ml_b + h * stride_ml_h + s)
        o_s = tl.load(Mid_o + b * stride_mo_b + h * stride_mo_h + s * stride_mo_s + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse_s)
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_new))
        w = tl.exp2(lse_s - m_new)
        acc = acc * alpha + w * o_s
        l = l * alpha + w
        m = m_new
    out = acc / l
    tl.store(O + b * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


def pick_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device, block_n: int = 64
) -> int:
    """Splits per request so that bs * Hkv * splits fills the GPU about 2 programs per SM, capped so no
    split is shorter than one block and at MAX_KV_SPLITS. Depends only on host values (no sync)."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    want = math.ceil(2 * num_sms / max(1, batch_size * num_kv_heads))
    return max(1, min(want, math.ceil(max(1, max_seq_len) / block_n), MAX_KV_SPLITS))


def alloc_decode_scratch(
    batch_size: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mid_o (bs, H, splits, D) float32, mid_lse (bs, H, splits) float32), reusable by every layer."""
    mid_o = torch.empty(batch_size, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    mid_o: Optional[torch.Tensor] = None,
    mid_lse: Optional[torch.Tensor] = None,
    config: Optional[DecodeKernelConfig] = None,
) -> torch.Tensor:
    """q (bs, H, D), k_buf/v_buf (num_slots, Hkv, D) -> out (bs, H, D), written in place and returned.

    req_to_token (rows, max_ctx) int32; req_pool_indices, seq_lens (bs,) int; seq_lens[i] >= 1.
    mid_o / mid_lse: scratch from alloc_decode_scratch (allocated here when omitted).
    config: stage 1's launch shape (default_kernel_config(k_buf.dtype) when omitted).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    if bs == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    if mid_o is None or mid_lse is None:
        mid_o, mid_lse = alloc_decode_scratch(bs, num_heads, head_dim, num_splits, q.device)
    config = config or default_kernel_config(k_buf.dtype)
    block_n = config.block_n
    block_d = triton.next_power_of_2(head_dim)
    _decode_stage1[(bs, num_kv_heads, num_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        out,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        num_splits,
        G=group,
        D=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        **dot_flags(q.dtype, q.device),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch_args(q.device),
    )
    if num_splits == 1:
        return out  # stage 1 wrote it
    _decode_stage2[(bs, num_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        seq_lens,
        num_splits,
        D=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        num_warps=1,
        **pdl.launch_args(q.device),
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch, one request at a time, float32 math: q (bs, H, D) -> (bs, H, D) in q's dtype."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_buf.shape[1]
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :n].long()
        k = k_buf[slots].float().repeat_interleave(group, dim=1)  # (n, H, D)
        v = v_buf[slots].float().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[i].float(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out
