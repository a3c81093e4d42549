"""TritonAttnBackend: paged attention with radixserve's own Triton kernels (kernels/triton/).

Per forward, init_forward_metadata sizes the launch from host lists (no device sync):
DECODE picks the split-K factor and allocates the float32 split scratch shared by every layer;
EXTEND records the longest extend length (the grid's third dimension). Per layer, forward stores
the new K/V into the pool (store_kv, unless the caller did: kv_stored), then runs decode_attention or
extend_attention.

The kernel modules import triton, so they are imported on first use: `import kernels` and the
registry stay cheap and work on CPU-only installs without triton. On CPU the kernels run only under
the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported), which tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.attention.base import AttentionBackend, ForwardBatchLike, graph_batch_size


@dataclass
class DecodeMeta:
    """What the Triton decode kernels need besides the batch: sized on the host, shared by every layer (also
    by FlashInfer's mixed steps for their decode rows, kernels/attention/flashinfer.py)."""

    num_splits: int
    """KV splits per request (stage-1 grid dim 3)."""
    mid_o: torch.Tensor
    """(bs, H, num_splits, D) float32, device — per-split normalized partial outputs."""
    mid_lse: torch.Tensor
    """(bs, H, num_splits) float32, device — per-split log2-sum-exp."""


def plan_decode(
    bs: int,
    split_bs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    device: torch.device,
    num_splits: Optional[int] = None,
) -> DecodeMeta:
    """Split count (`num_splits`, else the heuristic's for `split_bs` requests of at most `max_len` tokens)
    and scratch for a decode of `bs` requests. Decode steps pass their graph_batch_size as `split_bs`, so a
    batch is split the same way with CUDA graphs on and off (a split count above what a context needs leaves
    the extra splits empty, which changes no sum); a mixed step's decode rows, never replayed from a graph,
    pass their count."""
    from kernels.triton import decode_attention as dec

    splits = num_splits or dec.pick_num_kv_splits(split_bs, num_kv_heads, max_len, device)
    return DecodeMeta(splits, *dec.alloc_decode_scratch(bs, num_heads, head_dim, splits, device))


def run_decode(
    meta: DecodeMeta,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """kernels.triton.decode_attention.decode_attention with `meta`'s splits and scratch: q (bs, H, D) -> out."""
    from kernels.triton.decode_attention import decode_attention

    return decode_attention(
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, scale, meta.num_splits, meta.mid_o, meta.mid_lse
    )


@dataclass
class _ExtendMeta:
    max_extend_len: int
    """max(extend_seq_lens) — sizes the grid's query-block dimension."""


class TritonAttnBackend(AttentionBackend):
    """See AttentionBackend for the shapes of `forward`. `num_kv_splits`, when set, overrides the split
    heuristic (a fixed value keeps decode launches shape-stable, e.g. under CUDA graphs)."""

    def __init__(self, *args, num_kv_splits: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.req_to_token.device.type != "cuda":
            from kernels.triton import fix_interpreter_scalar_index

            fix_interpreter_scalar_index()  # CPU means the Triton interpreter
        self.num_kv_splits = num_kv_splits
        self._decode: Optional[DecodeMeta] = None
        self._extend: Optional[_ExtendMeta] = None

    def init_forward_metadata(self, batch: ForwardBatchLike) -> None:
        self._decode = self._extend = None
        if _is_decode(batch):
            bs = batch.batch_size
            max_len = max(batch.seq_lens_cpu) if bs else 0
            args = (self.num_heads, self.num_kv_heads, self.head_dim, max_len, self.req_to_token.device)
            self._decode = plan_decode(bs, graph_batch_size(bs), *args, num_splits=self.num_kv_splits)
        else:
            self._extend = _ExtendMeta(max(batch.extend_seq_lens_cpu) if batch.batch_size else 0)
        self._meta_batch = batch

    supports_cuda_graph = True

    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """See AttentionBackend.store_kv: one Triton launch for K and V (kernels/triton/store_kv.py)."""
        from kernels.triton.store_kv import store_kv

        store_kv(*self.kv_pool.get_kv_buffer(layer_id), loc, k, v)

    def init_forward_metadata_capture(self, batch: ForwardBatchLike) -> None:
        """Decode metadata of a captured batch size: the split count for any context length (the kernel
        sizes its chunks from the device seq_lens) and scratch owned by this graph."""
        bs = batch.batch_size
        args = (self.num_heads, self.num_kv_heads, self.head_dim, 1 << 30, self.req_to_token.device)
        self._graph_meta = getattr(self, "_graph_meta", {})
        self._graph_meta[bs] = plan_decode(bs, graph_batch_size(bs), *args, num_splits=self.num_kv_splits)
        self._decode, self._extend, self._meta_batch = self._graph_meta[bs], None, batch

    def init_forward_metadata_replay(self, batch: ForwardBatchLike) -> None:
        """Nothing to update on the host: the kernels read seq_lens and req_pool_indices on the device."""
        self._decode, self._extend, self._meta_batch = self._graph_meta[batch.batch_size], None, batch

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
        q = q if q.stride(-1) == 1 else q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._decode is not None:
            args = (self.req_to_token, batch.req_pool_indices, batch.seq_lens, self.scale)
            return run_decode(self._decode, q, k_buf, v_buf, out, *args)
        from kernels.triton.extend_attention import extend_attention

        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        return extend_attention(
            q,
            k,
            v,
            out,
            k_buf,
            v_buf,
            self.req_to_token,
            batch.req_pool_indices,
            batch.extend_prefix_lens,
            batch.extend_seq_lens,
            batch.extend_start_loc,
            self._extend.max_extend_len,
            self.scale,
        )


def _is_decode(batch: ForwardBatchLike) -> bool:
    mode = batch.forward_mode
    return getattr(mode, "value", mode) == "decode"
