"""Programmatic dependent launch (PDL): let a kernel start while the kernel before it is still finishing.

On Hopper and later GPUs a kernel launched with PDL may begin (its programs resident, its prologue running)
before the previous kernel in the stream has completed; it must execute `griddepcontrol.wait`
(`tl.extra.cuda.gdc_wait()`) before touching any memory that kernel may write or read, and it lets the next
kernel launch early with `gdc_launch_dependents()`. In a batch-1 decode step, hundreds of short kernels run
back to back, and the gap at each boundary (drain, launch, ramp-up) is a visible part of the step.

Contract for every kernel launched with `launch_args(device)`: it takes a `USE_PDL: tl.constexpr` argument
and, when it is set, calls `gdc_wait()` before its first load of an input written by an earlier kernel and
before its first store. Loads of memory no kernel writes (weights) may come before the wait. The wait covers
the whole chain: the previous kernel itself waited for its own predecessor before finishing.

Off (plain launches, `USE_PDL=False`) on CPU, under Triton's interpreter, on GPUs before Hopper, when
`set_enabled(False)` (EngineConfig.disable_pdl), and for the launches a thread makes inside `suspended()`:
the engine's decode steps whose matmuls are cuBLAS GEMMs (ModelRunner.decode_uses_pdl). There a kernel that
PDL launches early holds SM slots, waiting, while the GEMM before it still needs them. A kernel compiles
once per USE_PDL value, so both variants are built while the engine captures its CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import torch

_enabled = True
_local = threading.local()  # .off: this thread is inside suspended()


def set_enabled(on: bool) -> None:
    """Process-wide switch (the kernels are process-wide too); the engine sets it from its config."""
    global _enabled
    _enabled = bool(on)


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    from triton import knobs  # noqa: PLC0415  (imported where a launch asks: triton is loaded by then)

    if knobs.runtime.interpret:  # TRITON_INTERPRET, as Triton itself parses it
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@contextlib.contextmanager
def suspended(on: bool = True) -> Iterator[None]:
    """While open (and `on`), the kernels this thread launches run without PDL; nests, restores on exit."""
    before = getattr(_local, "off", False)
    _local.off = before or on
    try:
        yield
    finally:
        _local.off = before


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (by this thread, now)."""
    if not _enabled or getattr(_local, "off", False) or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a PDL-aware kernel launch on `device`: USE_PDL, and launch_pdl when on."""
    if enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
