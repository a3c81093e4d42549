"""AttentionBackend: the one interface every attention implementation serves.

A backend is built once per model runner with the request→token table and the
KV pool, then for every forward:

    backend.init_forward_metadata(batch)              # once per forward
    out = backend.forward(q, k, v, layer_id, batch)   # once per layer

`forward` first writes k, v of the new tokens into the pool at
`batch.out_cache_loc`, then attends each new token to its request's KV
positions [0, position] (causal). Given `out=`, it writes the result there
(the piecewise runner's static buffer) instead of allocating it. `kernels` does
not import `engine`: the batch and pool are used through the small protocols
below.
"""

from __future__ import annotations

import abc
import importlib
from typing import Callable, Dict, List, Optional, Protocol

import torch


def graph_batch_size(batch_size: int) -> int:
    """The power of two at or above `batch_size`: the CUDA graph a DECODE step of that size replays. Choices
    made per step (kernels, split counts) are decided on it, so a step runs the same kernels, and rounds the
    same way, with CUDA graphs on and off."""
    return 1 << max(batch_size - 1, 0).bit_length()


class KVPoolLike(Protocol):
    num_layers: int

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


class ForwardBatchLike(Protocol):
    forward_mode: object
    batch_size: int
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    seq_lens_cpu: List[int]
    extend_prefix_lens_cpu: List[int]
    extend_seq_lens_cpu: List[int]


class AttentionBackend(abc.ABC):
    """Paged attention over a KV pool.

    `req_to_token`: (max_requests, max_context_len) int32, device — KV slot of
    each position of each request. Shapes in `forward`: q (T, num_heads, head_dim),
    k and v (T, num_kv_heads, head_dim); returns (T, num_heads, head_dim) in q's dtype.
    """

    def __init__(
        self,
        req_to_token: torch.Tensor,
        kv_pool: KVPoolLike,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self._meta_batch: Optional[ForwardBatchLike] = None
        """The batch whose per-forward metadata is planned: `init_forward_metadata` and the CUDA-graph hooks
        set it; `forward` plans again for any other batch."""

    def init_forward_metadata(self, batch: ForwardBatchLike) -> None:
        """Precompute per-forward indices shared by all layers (default: nothing)."""

    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ((T, Hkv, D)) into layer `layer_id`'s KV buffers at slots `loc` ((T,) int): what `forward`
        does first unless `kv_stored`. Device work only (no host sync, no allocation the caller must keep), so
        a CUDA graph may capture it."""
        self.kv_pool.set_kv_buffer(layer_id, loc, k, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatchLike,
        out: Optional[torch.Tensor] = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) -> (T, H, D) in q's dtype; writes k/v at batch.out_cache_loc first
        (`store_kv`) unless `kv_stored`: the caller has written them there already (the piecewise runner does,
        inside its CUDA graphs). `out`: a contiguous (T, H, D) tensor of q's dtype, not overlapping q/k/v, that
        receives the result (returned); otherwise the result is a new tensor. Plans the batch first when it is
        not the planned one (`_meta_batch`); the attention itself is the backend's `_attend`."""
        if self._meta_batch is not batch:
            self.init_forward_metadata(batch)
        if not kv_stored:
            self.store_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        return self._attend(q, k, v, k_buf, v_buf, batch, out)

    @abc.abstractmethod
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
        """`forward`'s attention, the batch planned and its K/V in the pool: q (T, H, D) attends over layer
        buffers k_buf / v_buf ((num_slots, Hkv, D), this step's tokens included); k, v (T, Hkv, D) are this
        step's own (a backend may read them rather than the pool). `out` and the result as in `forward`."""

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    # A backend that supports graphs sets `supports_cuda_graph`. The graph runner then calls, for
    # every captured batch size bs, `init_forward_metadata_capture(batch)` outside the capture with a
    # DECODE batch whose device tensors are the runner's static buffers (their contents are dummies),
    # captures `forward` of every layer, and before each replay fills the static buffers with the real
    # (padded) batch and calls `init_forward_metadata_replay(batch)` on the same batch object, whose
    # host lists (`seq_lens_cpu`, ...) now hold the real values. Both must leave the device pointers
    # that the captured kernels read unchanged.
    supports_cuda_graph: bool = False

    def init_forward_metadata_capture(self, batch: ForwardBatchLike) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatchLike) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


# name -> "module:Class", imported on first use so GPU-only backends cost nothing on CPU.
_REGISTRY: Dict[str, str] = {
    "torch_native": "kernels.attention.torch_native:TorchNativeAttnBackend",
    "triton": "kernels.attention.triton:TritonAttnBackend",
    "flashinfer": "kernels.attention.flashinfer:FlashInferAttnBackend",
}


def register_backend(name: str, target: str) -> None:
    _REGISTRY[name] = target


def available_backends() -> List[str]:
    return sorted(_REGISTRY)


def get_backend_class(name: str) -> Callable[..., AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
