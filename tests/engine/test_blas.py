"""engine/runner/blas.py and EngineConfig.decode_blas_library: which BLAS library a step's matmuls use.

On CPU the switch changes nothing (torch's CPU matmuls have no cuBLAS); the GPU side (graphs captured with
cuBLASLt against eager steps) is tests/engine/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfigError
from engine.forward_batch import ForwardMode
from engine.runner import blas
from engine.runner.model_runner import ModelRunner


def test_preferred_leaves_cpu_and_cublas_alone():
    before = torch.backends.cuda.preferred_blas_library()
    for library, device in (("cublaslt", torch.device("cpu")), ("cublas", torch.device("cuda"))):
        with blas.preferred(library, device):
            assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before


def test_config_default_and_bad_library():
    assert EngineConfig().decode_blas_library == "cublaslt"
    assert EngineConfig(decode_blas_library="cublas").decode_blas_library == "cublas"
    with pytest.raises(InvalidConfigError, match="decode_blas_library"):
        EngineConfig(decode_blas_library="mkl")


class _Batch:
    def __init__(self, mode: ForwardMode):
        self.forward_mode = mode


@pytest.mark.parametrize("mode,library", [(ForwardMode.DECODE, "cublaslt"), (ForwardMode.EXTEND, "cublas")])
def test_runner_prefers_the_decode_library_for_decode_steps_only(monkeypatch, mode, library):
    """ModelRunner.blas_for: the configured library around DECODE steps, cuBLAS around prefill / mixed ones."""
    seen = []
    monkeypatch.setattr(blas, "preferred", lambda lib, device: seen.append((lib, device)) or "ctx")
    runner = ModelRunner.__new__(ModelRunner)  # blas_for reads only config and device
    runner.config = EngineConfig(decode_blas_library="cublaslt")
    runner.device = torch.device("cuda")
    assert runner.blas_for(_Batch(mode)) == "ctx"
    assert seen == [(library, torch.device("cuda"))]
