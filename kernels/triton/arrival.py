"""Arrival counters: one int32 per group of programs, for kernels whose last program to finish a group does
the group's final step (the GEMV's split-K sum, decode attention's merge of its KV splits).

Contract for a kernel that uses them: each program of a group stores its partial result, then (after a
barrier, so every thread's stores are issued) counts its arrival with an acq_rel atomic add; the program
that sees `group size - 1` reads every partial (bypassing L1) and resets the counter to zero. So between
launches every counter is zero, and one buffer per device serves every such kernel, provided their launches
do not run concurrently (the kernels of one stream do not: the engine's forward passes use one stream per
device, and with PDL a kernel touches the counters only after waiting for its predecessor).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

_COUNTERS: Dict[Tuple[str, int], torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed int32 counters on `device` (allocated once per device, at least 16K of them, so a
    CUDA graph captures the same buffer that eager launches use)."""
    key = (device.type, device.index if device.index is not None else -1)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def all_zero() -> bool:
    """Whether every counter of every device is back at zero (tests)."""
    return all(int(buf.abs().sum()) == 0 for buf in _COUNTERS.values())
