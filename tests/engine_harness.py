"""Helpers for tests that run the engine on the default model (CPU, float32 unless told otherwise)."""

from __future__ import annotations

# Eight diverse prompts: chat, code, lists, numbers, another language, a long instruction.
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List three primary colors:\n1.",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is 12 times 7?\nA:",
    "La recette de la tarte aux pommes commence par",
    "<|im_start|>user\nWrite a haiku about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
    "Explain in one sentence why the sky is blue, for a five-year-old child who asked at bedtime:",
]


TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)
"""config.json of a tiny Llama for dummy weights (load_format="dummy", skip_tokenizer_init=True)."""


def write_tiny_config(folder, **overrides) -> str:
    """Write TINY_LLAMA (with `overrides`) as `folder`/config.json; returns the folder as a string."""
    import json
    import os

    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(TINY_LLAMA, **overrides), f)
    return str(folder)


def make_engine(**kwargs):
    from engine import Engine

    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_total_tokens", 8192)
    return Engine(**kwargs)


def assert_no_leak(engine) -> None:
    """Idle engine: every slot is free or held by the radix cache, and nothing is locked."""
    s = engine.stats()
    assert s.running == 0 and s.waiting == 0, s
    assert s.kv_free_tokens + s.kv_evictable_tokens == s.kv_total_tokens, s
    assert s.kv_cached_tokens == s.kv_evictable_tokens, s
