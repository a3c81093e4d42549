"""TorchNativeAttnBackend: plain-torch paged attention, the reference every other backend is tested against.

EXTEND: one SDPA call per request over its gathered KV, with a causal mask
shifted by the request's prefix length. DECODE: the whole batch at once, over
KV gathered into (bs, max_seq_len) with a padding mask (two batched matmuls
and a float32 softmax). On CPU, fp16/bf16 inputs
are computed in float32 (returned in q's dtype).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, ForwardBatchLike


class _DecodeMeta:
    """Per-forward decode indices shared by all layers."""

    def __init__(self, kv_indices: torch.Tensor, mask: torch.Tensor):
        self.kv_indices = kv_indices
        """(bs, max_len) int64, device — KV slot of every position; padding points at slot 0."""
        self.mask = mask
        """(bs, 1, 1, max_len) bool, device — True where the position is < seq_len."""


class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend. See AttentionBackend for the shapes of `forward`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._decode_meta: Optional[_DecodeMeta] = None
        self._rows: Optional[torch.Tensor] = None

    def init_forward_metadata(self, batch: ForwardBatchLike) -> None:
        """Gather each request's req_to_token row once; DECODE also builds padded indices and mask."""
        max_len = max(batch.seq_lens_cpu) if batch.batch_size else 0
        self._rows = self.req_to_token[batch.req_pool_indices, :max_len].long()
        """(bs, max_len) int64 — KV slots of each request (garbage beyond its seq_len)."""
        self._decode_meta = None
        if _is_decode(batch):
            valid = torch.arange(max_len, device=self._rows.device)[None, :] < batch.seq_lens[:, None]
            self._decode_meta = _DecodeMeta(torch.where(valid, self._rows, 0), valid[:, None, None, :])
        self._meta_batch = batch

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        batch: ForwardBatchLike,
        out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """See AttentionBackend._attend."""
        compute_dtype = _compute_dtype(q)
        if self._decode_meta is not None:
            result = self._decode(q.to(compute_dtype), k_buf, v_buf, compute_dtype)
        else:
            result = self._extend(q.to(compute_dtype), k_buf, v_buf, compute_dtype, batch)
        return result.to(q.dtype) if out is None else out.copy_(result)

    def _decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q (bs, H, D): one token per request; all requests in two batched matmuls over padded KV.

        GQA without copying KV: q is viewed as (bs, Hkv, H // Hkv, D), query head h uses kv head h // (H // Hkv).
        """
        meta = self._decode_meta
        bs = q.shape[0]
        k = k_buf[meta.kv_indices].to(dtype).permute(0, 2, 3, 1)  # (bs, Hkv, D, max_len)
        v = v_buf[meta.kv_indices].to(dtype).transpose(1, 2)  # (bs, Hkv, max_len, D)
        qg = q.view(bs, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        scores = torch.matmul(qg, k).float() * self.scale  # (bs, Hkv, G, max_len) float32
        probs = scores.masked_fill(~meta.mask, float("-inf")).softmax(dim=-1).to(dtype)
        return torch.matmul(probs, v).reshape(bs, self.num_heads, self.head_dim)

    def _extend(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, dtype: torch.dtype, batch: ForwardBatchLike
    ) -> torch.Tensor:
        """q (T, H, D): request i's new rows [start, start + n) attend its KV [0, seq_len), causally."""
        out = torch.empty_like(q)
        start = 0
        for i, (n, prefix, seq_len) in enumerate(
            zip(batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu, batch.seq_lens_cpu)
        ):
            if n == 0:
                continue
            idx = self._rows[i, :seq_len]
            k = k_buf[idx].to(dtype).transpose(0, 1)  # (Hkv, seq_len, D)
            v = v_buf[idx].to(dtype).transpose(0, 1)
            # new row r sits at absolute position prefix + r and sees positions [0, prefix + r]
            mask = (
                torch.arange(seq_len, device=q.device)[None, :]
                <= torch.arange(prefix, prefix + n, device=q.device)[:, None]
            )
            qi = q[start : start + n].transpose(0, 1)  # (H, n, D)
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
            out[start : start + n] = o.transpose(0, 1)
            start += n
        return out


def _is_decode(batch: ForwardBatchLike) -> bool:
    mode = batch.forward_mode
    return getattr(mode, "value", mode) == "decode"


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float32 for half types on CPU (where low-precision SDPA is slow or inexact), else q's dtype."""
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return q.dtype
