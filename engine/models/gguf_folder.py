"""A GGUF file converted once per machine to a Hugging Face folder; every load reads that folder.

    converted_folder(source) ─▶ <cache>/gguf/<file stem>-<key>/
        config.json, generation_config.json     transformers' config of the GGUF metadata; eos_token_id:
                                                the GGUF eos / eot / eom ids (llama.cpp's end-of-turn keys)
        tokenizer.json, tokenizer_config.json   transformers' tokenizer of the GGUF vocabulary (chat template
                                                included)
        model.safetensors                       every tensor dequantized, with its HF name (q/k un-permuted
                                                by transformers' GGUF loader), in the dtype dequantization
                                                gives (float32 for quantized types, the file's own otherwise)
        COMPLETE                                written last: a folder without it is never read

    key   = sha256(real path, size, mtime, transformers version, FORMAT)[:16]: a changed file, or a
            transformers release that maps GGUF differently, converts again
    cache = $RADIXSERVE_CACHE, else ~/.cache/radixserve

Why: transformers reads a GGUF file's metadata with gguf.GGUFReader, which parses every vocabulary string
one at a time from a memory map (seconds per parse), and config, tokenizer, eos ids and weights each
parse the file again, in every process that loads the model (the front end, every worker replica and
its engine core). After one conversion, loads are plain config / tokenizer / safetensors reads.

Exactness: the engine casts each stored tensor to its dtype when it copies it in, which is the cast
transformers' loader applies after dequantizing, so weights are bit-identical to a direct GGUF load.

Concurrency: processes starting together (a cluster's replicas) convert once. The converter holds an
exclusive lock file beside the folder; the others wait on it, then read. A conversion is written to
a temporary folder and renamed into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile

from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.models.source import ModelSource

FORMAT = 1
"""Version of this folder layout: bump it when what a conversion writes changes."""
COMPLETE = "COMPLETE"
# GGUF metadata keys that name tokens ending a turn (llama.cpp's eos / end-of-turn / end-of-message).
GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def cache_root() -> str:
    """$RADIXSERVE_CACHE, else ~/.cache/radixserve."""
    return os.environ.get("RADIXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


def converted_folder(source: ModelSource) -> str:
    """The HF folder of GGUF `source`, converting the file first if this machine has not yet.

    Raises ModelNotFoundError when the file is missing, UnsupportedModelError when transformers
    cannot read it (unsupported architecture or tokenizer)."""
    path = source.gguf_path
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"GGUF file {path!r} does not exist")
    folder = _folder_for(path)
    if not _complete(folder):
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        with _exclusive(folder + ".lock"):
            if not _complete(folder):  # another process may have converted it while this one waited
                _convert(path, folder)
    return folder


def _folder_for(path: str) -> str:
    import transformers

    stat = os.stat(path)
    identity = f"{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}\0{FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{key}")


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMPLETE))


@contextlib.contextmanager
def _exclusive(lock_path: str):
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(path: str, folder: str) -> None:
    """Write the HF folder of GGUF file `path` to `folder` (replacing an incomplete one)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    parent, name = os.path.split(path)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(folder))
    try:
        try:
            config = AutoConfig.from_pretrained(parent, gguf_file=name, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name, local_files_only=True)
        except (ValueError, KeyError, OSError) as e:
            raise UnsupportedModelError(f"cannot convert GGUF file {path!r}: {e}") from e
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": _gguf_eos_ids(path)}, f)
        tensors = {name: t.contiguous() for name, t in _dequantized_tensors(path, config).items()}
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        for entry in os.listdir(tmp):  # mkdtemp and save_file create owner-only entries: readable by all
            os.chmod(os.path.join(tmp, entry), 0o644)
        os.chmod(tmp, 0o755)
        open(os.path.join(tmp, COMPLETE), "w").close()
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_eos_ids(path: str) -> list[int]:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    return [int(fields[k].parts[fields[k].data[0]][0]) for k in GGUF_EOS_KEYS if k in fields]


def _dequantized_tensors(path: str, config):
    """{HF name: dequantized CPU tensor}; transformers maps GGUF names using an HF model built on meta."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    with cached_gguf_name_map():
        return load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf_model)["tensors"]


@contextlib.contextmanager
def cached_gguf_name_map():
    """Memoize `gguf.get_tensor_name_map` while transformers maps GGUF names.

    transformers calls it once per submodule (~400 times for a 30-layer model, each
    rebuilding the same table); it is a pure function of (arch, n_blocks).
    """
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original
