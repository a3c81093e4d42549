"""kv_transfer: move KV pages from a prefill replica's pool into a decode replica's pool.

Data flow of one handoff (docs/disaggregation.md, Vocabulary) and who owns each stage:

    decode replica (receiver)                         prefill replica (sender)
    KVTransferBackend(name, kv buffers, page_size)    KVTransferBackend(name, kv buffers, page_size)
        info() ───────── PeerInfo (via Ray) ────────▶ connect(decode_info)
        connect(prefill_info) ◀──── PeerInfo ──────── info()
    allocates dst pages (engine), then
        expect(prefill, dst_pages, id) ─ dst_pages ─▶ computes the prompt (engine), then
                                                      write(decode, src_pages, dst_pages, id)
        await wait(handle, timeout) ◀── KV bytes ──── await wait(handle, timeout)
    decode continues from the handed-over pages       frees (or caches) its src pages

The engines own the pages on both sides and free them; backends only register the buffers
once, describe them (KVLayout, PeerInfo: frozen, picklable) and move bytes. `wait` always
releases the handle; failures raise KVTransferError, time-outs KVTransferTimeout.
A KVPool is token-major (engine/memory/kv_pool.py): `kv_pool_buffers` gives ONE buffer whose
page p holds every layer's K and V of its tokens, so a run of consecutive pages travels as one
region. On GPU a NIXL write waits (without blocking) for the kernels queued before it.

Backends (registry below, imported lazily): "nixl" (UCX; GPU or host memory) in nixl.py,
"nccl" (2-rank NCCL communicator per pair; GPU only) in nccl.py. The contract is in base.py.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

from cluster.kv_transfer.base import (
    MAX_MESSAGE_BYTES,
    KVLayout,
    KVTransferBackend,
    KVTransferError,  # noqa: F401
    KVTransferTimeout,
    PageRun,
    PeerInfo,
    TransferHandle,
    TransferStatus,
    page_run_arrays,
    page_runs,
    transfer_digest,
)

_BACKENDS = {
    "nixl": ("cluster.kv_transfer.nixl", "NixlBackend"),
    "nccl": ("cluster.kv_transfer.nccl", "NcclBackend"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def make_backend(
    name: str, agent_name: str, buffers: Sequence[Any], page_size: int, **kwargs: Any
) -> KVTransferBackend:
    """Build backend `name` over `buffers` (registered once; they must outlive the backend)."""
    if name not in _BACKENDS:
        raise KVTransferError(f"unknown KV transfer backend {name!r}; available: {available_backends()}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(agent_name, buffers, page_size, **kwargs)


def kv_pool_buffers(pool: Any) -> list[Any]:
    """A KVPool's memory as transfer buffers: one buffer, (num_slots, values per token), slot rows contiguous
    (the pool is token-major), so a run of consecutive slots travels as one region across all layers."""
    return [pool.slot_rows()]
