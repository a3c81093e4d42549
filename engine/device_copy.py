"""Host → device copies that never make the host wait for the device's queued work."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (a host tensor) on `device` (optionally cast first, on the host).

    On CUDA the copy is non-blocking, from pinned memory (a true asynchronous DMA; the caching host
    allocator keeps the pinned block until the copy has run). A blocking copy synchronizes the stream:
    the CPU would wait for every kernel queued before it, i.e. for the batch still running, which
    defeats overlap scheduling. Elsewhere a plain copy.
    """
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
