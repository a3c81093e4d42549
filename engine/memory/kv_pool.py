"""KVPool: the physical per-layer K and V tensors of one replica.

Slot s of layer l holds the key/value of one token: k_buffers[l][s] is
(num_kv_heads, head_dim). Slots [0, page_size) (page 0) are never handed out:
they absorb writes of padded tokens (CUDA-graph padding) so real pages stay intact.
"""
from __future__ import annotations

from typing import List

import torch


class KVPool:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        """num_layers × (num_slots, num_kv_heads, head_dim), dtype, device."""
        self.v_buffers: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        """num_layers × (num_slots, num_kv_heads, head_dim), dtype, device."""

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ((T, num_kv_heads, head_dim)) into slots `loc` ((T,) int64)."""
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)
