"""Model loading: ModelSource -> HF config -> our model class -> weights on the device.

load_config(source)                          config.json (of a GGUF file: of its converted folder)
load_model(source, config, format, ...)      build on meta, materialize on `device` in `dtype`, then
    "safetensors": stream every tensor of *.safetensors (sharded via model.safetensors.index.json)
    "gguf":        the dequantized tensors of the GGUF file's converted folder (engine.models.gguf_folder:
                   converted once per machine by transformers' GGUF loader; HF names, q/k un-permuted)
    "dummy":       seeded random weights with the real shapes; no weight file is read
    "auto":        "gguf" for a GGUF source, else "safetensors"
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator, List, Tuple

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.models.gguf_folder import converted_folder
from engine.models.registry import get_model_class
from engine.models.source import ModelSource

_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def load_config(source: ModelSource) -> PretrainedConfig:
    """The model's transformers config; ModelNotFoundError / UnsupportedModelError with the reason."""
    folder = converted_folder(source) if source.is_gguf else source.folder
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelNotFoundError(f"model folder {folder!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"cannot read the config of model {source.name!r}: {e}") from e
    except OSError as e:
        raise ModelNotFoundError(f"cannot read the config of model {source.name!r}: {e}") from e


def load_model(
    source: ModelSource,
    config: PretrainedConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> nn.Module:
    """Build the model for `config` directly on `device` in `dtype`, fill its weights; eval mode, no grad."""
    fmt = _resolve_format(source, load_format)
    model_cls = get_model_class(config)
    device = torch.device(device)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_cls(config)
    model = model.to_empty(device=device)  # allocates once, on the target device, uninitialized
    model.eval().requires_grad_(False)
    with torch.no_grad():
        if fmt == "dummy":
            _init_dummy(model, config, seed)
        elif fmt == "gguf":
            model.load_weights(_iter_safetensors(converted_folder(source)))
        else:
            model.load_weights(_iter_safetensors(source.folder))
    return model


def _resolve_format(source: ModelSource, load_format: str) -> str:
    if load_format not in _FORMATS:
        raise UnsupportedModelError(f"unknown load_format {load_format!r}; use one of {', '.join(_FORMATS)}")
    if load_format == "auto":
        return "gguf" if source.is_gguf else "safetensors"
    if load_format == "gguf" and not source.is_gguf:
        raise UnsupportedModelError(f"load_format 'gguf' needs a .gguf model; {source.folder!r} is a HF folder")
    if load_format == "safetensors" and source.is_gguf:
        raise UnsupportedModelError(f"load_format 'safetensors' needs a HF folder; {source.gguf_path!r} is GGUF")
    return load_format


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(folder: str) -> List[str]:
    """The checkpoint's shard files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelNotFoundError(f"shards listed in {index!r} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"model folder {folder!r} has no *.safetensors weight files")
    return files


def _iter_safetensors(folder: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of every shard, one tensor in memory at a time."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _init_dummy(model: nn.Module, config: PretrainedConfig, seed: int) -> None:
    """Seeded random weights: N(0, initializer_range) matrices, zero biases, unit norms."""
    std = float(getattr(config, "initializer_range", 0.02))
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif param.dim() == 1:  # RMSNorm weights
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)
