"""Fixtures shared by every test folder: the GPU marker's skip, engines on the default model (CPU, float32).

Helpers that tests import (prompts, make_engine, assert_no_leak) live in engine_harness.py: a test module
never imports a conftest (each folder may have its own).
"""

from __future__ import annotations

import os

import pytest

from engine_harness import make_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_engine():
    engine = make_engine()
    yield engine
    engine.shutdown()
