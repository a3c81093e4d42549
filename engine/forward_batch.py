"""ForwardBatch: the device tensors of one model forward, built from a ScheduleBatch.

Token layout (EXTEND): the new tokens of every request, concatenated in batch
order. Request i owns rows [extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i]).
Its KV for positions [0, extend_prefix_lens[i]) is already in the pool (cached
prefix or earlier chunks); this forward writes positions
[extend_prefix_lens[i], seq_lens[i]) at `out_cache_loc`.

DECODE is the special case of one new token per request (T == batch_size).

`packed` is the one host int64 tensor a batch is built from (copied to the device in one go), laid out

    [input_ids (T), positions (T), req_pool_indices (bs), seq_lens (bs), extend_prefix_lens (bs),
     extend_seq_lens (bs), extend_start_loc (bs), out_cache_loc (T)]

Tensor-parallel ranks rebuild rank 0's batch from it (`from_packed`, engine.parallel.step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional

import torch

from engine.device_copy import to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    """(T,) int64, device — token ids of the new tokens."""
    positions: torch.Tensor
    """(T,) int64, device — absolute position of each new token."""
    out_cache_loc: torch.Tensor
    """(T,) int64, device — KV slot each new token's K/V is written to."""
    req_pool_indices: torch.Tensor
    """(bs,) int64, device — row of each request in ReqToTokenPool.req_to_token."""
    seq_lens: torch.Tensor
    """(bs,) int64, device — KV length of each request after this forward."""
    extend_prefix_lens: torch.Tensor
    """(bs,) int64, device — tokens already in the KV pool before this forward."""
    extend_seq_lens: torch.Tensor
    """(bs,) int64, device — new tokens of each request in this forward (1 in DECODE)."""
    extend_start_loc: torch.Tensor
    """(bs,) int64, device — first row of each request in the token layout."""
    seq_lens_cpu: List[int]
    extend_prefix_lens_cpu: List[int]
    extend_seq_lens_cpu: List[int]
    extend_start_loc_cpu: List[int]
    attn_backend: Optional[object] = None
    """kernels.attention.base.AttentionBackend set by the ModelRunner; layers call attn_backend.forward."""
    packed: Optional[torch.Tensor] = None
    """Host int64, the layout of the module docstring (None when out_cache_loc came on the device). Its
    input ids are those planned: overlap scheduling may replace `input_ids` on the device afterwards."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_token_rows(self) -> torch.Tensor:
        """(bs,) int64 — row of each request's last new token (whose logits are sampled)."""
        return self.extend_start_loc + self.extend_seq_lens - 1

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: List[int],
        positions: List[int],
        out_cache_loc: torch.Tensor,
        req_pool_indices: List[int],
        seq_lens: List[int],
        prefix_lens: List[int],
        device: torch.device,
    ) -> "ForwardBatch":
        """Build from host lists; `out_cache_loc` is already a tensor (from the allocator)."""
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        starts, acc = [], 0
        for n in extend_lens:
            starts.append(acc)
            acc += n

        # One host tensor, one host-to-device copy; the fields are views into it.
        parts = [input_ids, positions, req_pool_indices, seq_lens, prefix_lens, extend_lens, starts]
        sizes = [len(part) for part in parts]
        host = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
        loc_on_host = out_cache_loc.device.type == "cpu"
        if loc_on_host:
            host = torch.cat([host, out_cache_loc.reshape(-1).to(torch.int64)])
            sizes.append(out_cache_loc.numel())
        fields = to_device(host, device).split(sizes)
        loc = fields[7] if loc_on_host else out_cache_loc.to(device=device, dtype=torch.int64)
        return cls(
            forward_mode=mode,
            batch_size=len(seq_lens),
            input_ids=fields[0],
            positions=fields[1],
            out_cache_loc=loc,
            req_pool_indices=fields[2],
            seq_lens=fields[3],
            extend_prefix_lens=fields[4],
            extend_seq_lens=fields[5],
            extend_start_loc=fields[6],
            seq_lens_cpu=list(seq_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=extend_lens,
            extend_start_loc_cpu=starts,
            packed=host if loc_on_host else None,
        )

    @classmethod
    def from_packed(
        cls,
        mode: ForwardMode,
        packed: torch.Tensor,
        batch_size: int,
        device: torch.device,
        input_ids: Optional[torch.Tensor] = None,
    ) -> "ForwardBatch":
        """The batch whose `packed` tensor this is (host int64, out_cache_loc included), on `device`;
        `input_ids` (device, (T,)) replaces the packed ones when given."""
        bs = batch_size
        tokens = (packed.numel() - 5 * bs) // 3
        sizes = [tokens, tokens, bs, bs, bs, bs, bs, tokens]
        host = packed.split(sizes)
        fields = to_device(packed, device).split(sizes)
        return cls(
            forward_mode=mode,
            batch_size=bs,
            input_ids=fields[0] if input_ids is None else input_ids,
            positions=fields[1],
            out_cache_loc=fields[7],
            req_pool_indices=fields[2],
            seq_lens=fields[3],
            extend_prefix_lens=fields[4],
            extend_seq_lens=fields[5],
            extend_start_loc=fields[6],
            seq_lens_cpu=host[3].tolist(),
            extend_prefix_lens_cpu=host[4].tolist(),
            extend_seq_lens_cpu=host[5].tolist(),
            extend_start_loc_cpu=host[6].tolist(),
            packed=packed,
        )
