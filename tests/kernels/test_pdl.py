"""kernels/triton/pdl.py's switches, and which decode steps the engine runs with PDL (on CPU: PDL's support
check is replaced by "supported", so no kernel runs)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from engine.config import EngineConfig  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from kernels.triton import pdl  # noqa: E402

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def supported(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    monkeypatch.setattr(pdl, "_enabled", True)


def test_suspended_turns_pdl_off_for_this_thread_only(supported):
    assert pdl.launch_args(CUDA0) == {"USE_PDL": True, "launch_pdl": True}
    seen = {}
    with pdl.suspended():
        assert pdl.launch_args(CUDA0) == {"USE_PDL": False}
        other = threading.Thread(target=lambda: seen.update(other=pdl.enabled(CUDA0)))
        other.start()
        other.join()
        with pdl.suspended(False):  # nested: stays off
            assert not pdl.enabled(CUDA0)
        assert not pdl.enabled(CUDA0)
    assert seen == {"other": True}
    assert pdl.enabled(CUDA0)
    with pdl.suspended(False):
        assert pdl.enabled(CUDA0)


def test_suspended_restores_on_error(supported):
    with pytest.raises(RuntimeError), pdl.suspended():
        raise RuntimeError("step failed")
    assert pdl.enabled(CUDA0)


SIZES = [1, 2, 3, 4, 5, 9, 16, 17, 32, 64, 256]


@pytest.mark.parametrize(
    "options,with_pdl",
    [
        (dict(), [1, 2, 3, 4, 5, 9, 16]),  # the GEMV kernels' steps, by the graph each pads to
        (dict(gemv_max_rows=4), [1, 2, 3, 4]),  # 5 pads to 8
        (dict(gemv_max_rows=1), [1]),
        (dict(gemv_max_rows=0), []),  # cuBLAS for every matmul
        (dict(disable_gemv=True), []),
    ],
)
def test_decode_steps_with_pdl_are_those_of_the_gemv_kernels(options, with_pdl):
    runner = SimpleNamespace(config=EngineConfig(device="cpu", **options))
    assert [bs for bs in SIZES if ModelRunner.decode_uses_pdl(runner, bs)] == with_pdl
