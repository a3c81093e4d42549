"""Greedy argmax and Gumbel-max sampling over the logits (the GPU path of engine/runner/sampler.py).

    argmax(logits (bs, V) float32) -> (bs,) int64, the lowest index of each row's maximum
        torch.argmax reduces a row in one thread block (~27 us for a 128K vocabulary on an H100, a visible
        part of a 5 ms batch-1 decode step); here each row is cut into chunks reduced in parallel, then the
        chunks' winners are merged. NaN logits are never chosen (torch.argmax would pick a NaN).

    gumbel_argmax(logits (bs, V) float32, row_keys (bs,) int64) -> (bs,) int64
        = argmax_v  logits[i, v] - log(-log(u(i, v)))

u(i, v) is the sampler's counter-based uniform: x = mix(mix(v ^ k1) ^ k2) with k1 the row key (from the
request's seed and step) and k2 = mix(k1 ^ TOKEN_SALT), u = ((x >> 9) + 0.5) * 2^-23. The torch path
materialises the (bs, V) noise through ~20 elementwise kernels; this kernel hashes, adds and reduces in
registers, one program per row, and breaks ties toward the lowest index like torch.argmax. Integer hashing
is the same int64 arithmetic as the torch code (values < 2^32, products < 2^63), so the noise is
bit-identical up to the float32 log, which both sides take from CUDA's libdevice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _gumbel_argmax_kernel(Logits, Keys, Out, stride_l, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k1 = tl.load(Keys + row).to(tl.int64)
    k2 = _mix32(k1 ^ 0x5851F42D)
    best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, dtype=tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        logit = tl.load(Logits + row * stride_l + offs, mask=mask, other=float("-inf"))
        x = _mix32(_mix32(offs.to(tl.int64) ^ k1) ^ k2)
        u = ((x >> 9).to(tl.float32) + 0.5) * (2.0**-23)
        val = logit - tl.log(-tl.log(u))
        val = tl.where(mask, val, float("-inf"))
        better = val > best_val  # strict: an earlier block keeps ties
        best_idx = tl.where(better, offs.to(tl.int64), best_idx)
        best_val = tl.where(better, val, best_val)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(Out + row, tl.where(idx == 2147483647, 0, idx))  # an all -inf row gives 0, as torch.argmax


@triton.jit
def _argmax_chunks_kernel(Logits, Mid_val, Mid_idx, stride_l, V, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    val = tl.load(Logits + row * stride_l + offs, mask=offs < V, other=float("-inf"))
    val = tl.where(val == val, val, float("-inf"))  # NaN never wins
    top = tl.max(val, axis=0)
    idx = tl.min(tl.where(val == top, offs, 2147483647), axis=0)
    tl.store(Mid_val + row * num_chunks + chunk, top)
    tl.store(Mid_idx + row * num_chunks + chunk, idx)


@triton.jit
def _argmax_merge_kernel(Mid_val, Mid_idx, Out, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_chunks
    val = tl.load(Mid_val + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idx = tl.load(Mid_idx + row * num_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(val, axis=0)
    best = tl.min(tl.where(val == top, idx, 2147483647), axis=0)  # chunks hold ascending indices
    tl.store(Out + row, tl.where(best == 2147483647, 0, best).to(tl.int64))  # all -inf: 0, as torch


def argmax(logits: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """logits (bs, V) float32 (last dim contiguous) -> (bs,) int64: the first index of each row's maximum."""
    bs, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs == 0:
        return out
    chunks = triton.cdiv(vocab, block)
    mid_val = torch.empty((bs, chunks), dtype=torch.float32, device=logits.device)
    mid_idx = torch.empty((bs, chunks), dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(bs, chunks)](
        logits, mid_val, mid_idx, logits.stride(0), vocab, chunks, BLOCK=block, num_warps=4
    )
    _argmax_merge_kernel[(bs,)](mid_val, mid_idx, out, chunks, BLOCK=triton.next_power_of_2(chunks), num_warps=1)
    return out


def gumbel_argmax(logits: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """logits (bs, V) float32 (last dim contiguous), row_keys (bs,) int64 in [0, 2^32) -> (bs,) int64 ids."""
    bs, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs:
        _gumbel_argmax_kernel[(bs,)](
            logits, row_keys.contiguous(), out, logits.stride(0), vocab, BLOCK=2048, num_warps=8
        )
    return out
