"""Model loading: ModelSource -> HF config -> our model class -> weights on the device.

load_config(source)                          config.json (of a GGUF file: of its converted folder)
load_model(source, config, format, ...)      build on meta, materialize on `device` in `dtype`, then
    "safetensors": stream every tensor of *.safetensors (sharded via model.safetensors.index.json)
    "gguf":        the dequantized tensors of the GGUF file's converted folder (engine.models.gguf_folder:
                   converted once per machine by transformers' GGUF loader; HF names, q/k un-permuted)
    "dummy":       seeded random weights with the real shapes; no weight file is read
    "auto":        "gguf" for a GGUF source, else "safetensors"

A tensor-parallel rank (`tp`) builds only its shard and reads only its slice of each checkpoint tensor
(safetensors slices: the rest of the file is never read); a GGUF model's converted folder is read the same
way. Its dummy weights are the TP=1 dummy weights, sliced: each full parameter is drawn in turn, with the
same generator in the same order as TP=1 does, and this rank keeps its slice, so the shards of N ranks
put together equal the TP=1 weights.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.models.gguf_folder import converted_folder
from engine.models.registry import get_model_class
from engine.models.source import ModelSource
from engine.parallel.shard import TensorParallel

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
    tp: Optional[TensorParallel] = None,
) -> nn.Module:
    """Build the model for `config` directly on `device` in `dtype`, fill its weights; eval mode, no grad.
    With `tp`: this rank's shard only (see the module docstring)."""
    fmt = _resolve_format(source, load_format)
    model_cls = get_model_class(config)
    device = torch.device(device)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_cls(config) if tp is None else model_cls(config, tp=tp)
    model = model.to_empty(device=device)  # allocates once, on the target device, uninitialized
    model.eval().requires_grad_(False)
    lazy = tp is not None
    with torch.no_grad():
        if fmt == "dummy" and tp is None:
            _init_dummy(model, config, seed)
        elif fmt == "dummy":
            model.load_weights(_dummy_checkpoint(model_cls, config, dtype, device, seed))
        elif fmt == "gguf":
            model.load_weights(_iter_safetensors(converted_folder(source), lazy))
        else:
            model.load_weights(_iter_safetensors(source.folder, lazy))
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


def _iter_safetensors(folder: str, lazy: bool = False) -> Iterator[Tuple[str, Any]]:
    """(HF name, CPU tensor) for every tensor of every shard, one tensor in memory at a time. `lazy`: a
    safetensors slice instead, valid until the next item, from which the consumer reads what it needs."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def _fill_dummy(name: str, param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """One parameter's seeded random value: N(0, std) for matrices, zero for biases, one for norms."""
    if name.endswith(".bias"):
        param.zero_()
    elif param.dim() == 1:  # RMSNorm weights
        param.fill_(1.0)
    else:
        param.normal_(0.0, std, generator=gen)


def _init_dummy(model: nn.Module, config: PretrainedConfig, seed: int) -> None:
    """Seeded random weights: N(0, initializer_range) matrices, zero biases, unit norms."""
    std = float(getattr(config, "initializer_range", 0.02))
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        _fill_dummy(name, param, std, gen)


def _dummy_checkpoint(
    model_cls: type, config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The TP=1 dummy weights as HF-named tensors: each parameter of the unsharded model (built on the meta
    device: no memory) drawn in turn on `device`, as `_init_dummy` draws it, one parameter in memory at a
    time."""
    with torch.device("meta"), _default_dtype(dtype):
        full = model_cls(config)
    std = float(getattr(config, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in full.named_parameters():
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        _fill_dummy(name, value, std, gen)
        yield from full.checkpoint_tensors(name, value)
