"""Gumbel-max sampling in one pass over the logits (the GPU path of engine/runner/sampler.py).

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
        u = ((x >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)
        val = logit - tl.log(-tl.log(u))
        val = tl.where(mask, val, float("-inf"))
        better = val > best_val  # strict: an earlier block keeps ties
        best_idx = tl.where(better, offs.to(tl.int64), best_idx)
        best_val = tl.where(better, val, best_val)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(Out + row, tl.where(idx == 2147483647, 0, idx))  # an all -inf row gives 0, as torch.argmax


def gumbel_argmax(logits: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """logits (bs, V) float32 (last dim contiguous), row_keys (bs,) int64 in [0, 2^32) -> (bs,) int64 ids."""
    bs, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs:
        _gumbel_argmax_kernel[(bs,)](logits, row_keys.contiguous(), out, logits.stride(0), vocab, BLOCK=2048,
                                     num_warps=8)
    return out
