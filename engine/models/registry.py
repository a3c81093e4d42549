"""Model registry: HF architecture name (or model_type) -> our model class, imported on first use.

A config names its class in `config.architectures` (HF folders); configs parsed
from GGUF files carry only `model_type`, so that is the fallback key.
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Type

from torch import nn
from transformers import PretrainedConfig

from engine.errors import UnsupportedModelError

_LLAMA = "engine.models.llama:LlamaForCausalLM"

# HF architecture -> "module:Class"
_ARCHITECTURES: Dict[str, str] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
}
# config.model_type -> architecture, for configs without `architectures` (GGUF, hand-built)
_MODEL_TYPES: Dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> List[str]:
    return sorted(_ARCHITECTURES)


def architecture_of(config: PretrainedConfig) -> str:
    """The architecture name a config asks for: architectures[0], else derived from model_type."""
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", None)
    return _MODEL_TYPES.get(model_type, f"<model_type {model_type!r}>")


def get_model_class(config: PretrainedConfig) -> Type[nn.Module]:
    """Our class for `config`; raises UnsupportedModelError naming the architecture and the supported ones."""
    arch = architecture_of(config)
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"model architecture {arch} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, cls = _ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(module), cls)
