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

Sharing with another process of the machine (`export` → KVPoolHandle → `map_kv_pool`): a disaggregated worker
whose engine core runs in a process of its own moves KV pages in and out of the core's pool from the worker's
process. CUDA memory is exported through CUDA IPC (torch.multiprocessing's reduction of the tensor); CPU memory
must have been allocated `shared` (a named POSIX shared-memory segment, /dev/shm). The pool's owner keeps the
memory alive and removes the segment's name on `close`; a mapping stays valid while its process holds it. The
engine orders every access: a page is read or written by the other process only while the core holds it for
that transfer (docs/disaggregation.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class KVPoolHandle:
    """What another process of this machine needs to map a KVPool's memory (picklable)."""

    shape: Tuple[int, ...]
    """kv_data's shape: (num_slots, num_layers, 2, num_kv_heads, head_dim)."""
    dtype: torch.dtype
    shm_name: Optional[str] = None
    """CPU: the shared-memory segment that holds kv_data."""
    cuda_ipc: Optional[Tuple[Any, tuple]] = None
    """CUDA: torch.multiprocessing.reductions.reduce_tensor(kv_data), (rebuild function, its arguments)."""


class MappedKVPool:
    """Another process's KVPool memory mapped into this one (map_kv_pool); owns the mapping."""

    def __init__(self, kv_data: torch.Tensor, segment: Optional[shared_memory.SharedMemory] = None):
        self.kv_data = kv_data
        self._segment = segment

    def slot_rows(self) -> torch.Tensor:
        """(num_slots, values per token) view, as KVPool.slot_rows."""
        return self.kv_data.view(self.kv_data.shape[0], -1)


def map_kv_pool(handle: KVPoolHandle) -> MappedKVPool:
    """Map the pool that `handle` describes (KVPool.export, in another process of this machine)."""
    if handle.cuda_ipc is not None:
        rebuild, args = handle.cuda_ipc
        return MappedKVPool(rebuild(*args))
    if handle.shm_name is None:
        raise ValueError("a KVPoolHandle names a shared-memory segment or a CUDA IPC handle")
    segment = shared_memory.SharedMemory(name=handle.shm_name)
    # Python before 3.13 registers an attached segment with this process's resource tracker, which would remove
    # it when this process exits: the owner removes it (KVPool.close), so this process forgets it.
    resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 - the name the tracker knows
    return MappedKVPool(_tensor_in(segment, handle.shape, handle.dtype), segment)


def _tensor_in(segment: shared_memory.SharedMemory, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over the start of `segment`'s memory (no copy)."""
    return torch.frombuffer(segment.buf, dtype=dtype, count=math.prod(shape)).view(shape)


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        shared: bool = False,
    ):
        """`shared`: on CPU, allocate kv_data in a named shared-memory segment so that `export` can hand it to
        another process (CUDA memory can be exported either way)."""
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_slots, num_layers, 2, num_kv_heads, head_dim)
        self._segment: Optional[shared_memory.SharedMemory] = None
        if shared and torch.device(device).type == "cpu":
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self._segment = shared_memory.SharedMemory(create=True, size=size)
            self.kv_data = _tensor_in(self._segment, shape, dtype)  # a new segment reads as zeros, like torch.zeros
        else:
            self.kv_data = torch.zeros(shape, dtype=dtype, device=device)
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

    def export(self) -> KVPoolHandle:
        """A handle with which another process of this machine maps this pool's memory (map_kv_pool). CPU pools
        must have been allocated `shared`."""
        shape, dtype = tuple(self.kv_data.shape), self.kv_data.dtype
        if self.kv_data.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

            return KVPoolHandle(shape, dtype, cuda_ipc=reduce_tensor(self.kv_data))
        if self._segment is None:
            raise RuntimeError("this KV pool is not shared: allocate it with shared=True (EngineConfig.share_kv_pool)")
        return KVPoolHandle(shape, dtype, shm_name=self._segment.name)

    def close(self) -> None:
        """Remove the shared segment's name (idempotent); its memory goes when the last mapping does."""
        segment, self._segment = self._segment, None
        if segment is not None:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ((T, num_kv_heads, head_dim)) into slots `loc` ((T,) int64)."""
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)
