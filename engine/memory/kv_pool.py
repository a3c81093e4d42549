"""KVPool: the physical K and V memory of one replica, token-major.

One tensor `kv_data` of shape (num_slots, num_layers, 2, num_kv_heads, head_dim) holds everything: slot s
keeps the keys and values of one token for every layer, `bytes_per_token` contiguous bytes. Layer l's K and V
are strided views

    k_buffers[l] = kv_data[:, l, 0]    v_buffers[l] = kv_data[:, l, 1]    (num_slots, num_kv_heads, head_dim)

whose slot stride is num_layers * 2 * num_kv_heads * head_dim elements (the last two dims are contiguous), so
every attention backend indexes them by slot exactly as it would index per-layer tensors.

Why token-major: a run of consecutive slots is ONE contiguous byte range across all layers, so a KV handoff
(cluster/kv_transfer) moves it as one region instead of 2 × num_layers regions, which the transfer engines
move far faster (benchmarks/README.md, KV transfer).

Slots [0, page_size) (page 0) are never handed out: they absorb writes of padded tokens (CUDA-graph padding)
so real pages stay intact.
"""

from __future__ import annotations

from typing import List

import torch


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.kv_data = torch.zeros((num_slots, num_layers, 2, num_kv_heads, head_dim), dtype=dtype, device=device)
        """(num_slots, num_layers, 2, num_kv_heads, head_dim), contiguous: index 0 of dim 2 is K, 1 is V."""
        self.k_buffers: List[torch.Tensor] = [self.kv_data[:, layer, 0] for layer in range(num_layers)]
        """num_layers × (num_slots, num_kv_heads, head_dim) strided views of kv_data."""
        self.v_buffers: List[torch.Tensor] = [self.kv_data[:, layer, 1] for layer in range(num_layers)]
        """num_layers × (num_slots, num_kv_heads, head_dim) strided views of kv_data."""

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def slot_rows(self) -> torch.Tensor:
        """kv_data as (num_slots, bytes_per_token // element size): row s is slot s's whole KV (a view)."""
        return self.kv_data.view(self.num_slots, -1)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ((T, num_kv_heads, head_dim)) into slots `loc` ((T,) int64)."""
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)
