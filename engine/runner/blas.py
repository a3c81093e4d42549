"""The BLAS library of a step's matmuls (torch's process-wide preference, set for the step's duration).

torch routes F.linear to cuBLAS by default; with cuBLASLt preferred, the same products go through
cuBLASLt's heuristics instead. For the decode step's products of 17 to a few hundred rows those pick
faster kernels on Hopper, but each call costs more host time, which an eager prefill step pays hundreds
of times while a replayed CUDA graph pays nothing. So the engine prefers cuBLASLt around decode forwards
only (EngineConfig.decode_blas_library): their graph captures, and the eager decode steps that must run
the same kernels as the graphs.

Contract: `preferred(library, device)` is a context manager; on anything but a CUDA device, or for
"cublas" (torch's default), it changes nothing. The preference is torch's global, so the engine's forward
passes must not run concurrently with other matmuls of the process that expect the default (the engine
runs its forwards on one thread per device).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def preferred(library: str, device: torch.device) -> Iterator[None]:
    """Prefer `library` ("cublas" | "cublaslt") for torch's matmuls inside the block, then restore the
    previous preference."""
    if device.type != "cuda" or library == "cublas":
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
