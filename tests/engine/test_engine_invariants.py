"""The greedy-output invariant (docs/design.md) on the default model, CPU float32.

Reference 1: Hugging Face transformers on the same dequantized weights.
Reference 2: the engine's own default configuration; every optimisation
(chunked prefill, prefix reuse, page sizes, retraction, batch composition)
must reproduce its greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

from engine_harness import PROMPTS, assert_no_leak, make_engine
from model_harness import hf_model_from_gguf

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def reference(default_engine):
    return [o.token_ids for o in default_engine.generate(PROMPTS, GREEDY)]


def test_greedy_matches_transformers(default_engine):
    """8 diverse prompts × 48 new tokens, run together as one batch, equal HF generate token for token."""
    ours = default_engine.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True})
    hf = hf_model_from_gguf(default_engine.source, default_engine.runner.model_config)
    # One left-padded batch (HF derives positions from the attention mask); EOS off to get all 48 tokens.
    prompts = [default_engine.tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=48, pad_token_id=0)
    for prompt, out, expected in zip(PROMPTS, ours, ref[:, width:].tolist()):
        assert out.token_ids == expected, f"prompt {prompt!r}: ours {out.text!r}"
    assert_no_leak(default_engine)


@pytest.mark.parametrize(
    "options",
    [
        dict(chunked_prefill_size=7),
        dict(chunked_prefill_size=64),
        dict(page_size=16, chunked_prefill_size=16),
        dict(page_size=16),
        dict(schedule_policy="fcfs", max_running_requests=3),
        dict(disable_radix_cache=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_greedy_unchanged_by_engine_options(reference, options):
    with make_engine(**options) as engine:
        got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert got == reference
        assert_no_leak(engine)


def test_greedy_unchanged_by_retraction(reference):
    # A pool too small for all eight requests at once forces decode-time retraction.
    with make_engine(max_total_tokens=192, page_size=16, new_token_ratio=0.0) as engine:
        got = [o.token_ids for o in engine.generate(PROMPTS, {**GREEDY, "ignore_eos": False})]
        stats = engine.stats()
        assert stats.retractions > 0, stats
        assert got == reference
        assert_no_leak(engine)


def test_greedy_unchanged_by_prefix_reuse_and_batch_composition(default_engine, reference):
    # Same prompts again: served from the radix cache.
    again = default_engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == reference
    assert all(o.cached_tokens > 0 for o in again if o.prompt_tokens > 1)
    # Alone, reversed, and mixed with other requests.
    assert [default_engine.generate(p, GREEDY).token_ids for p in PROMPTS[:3]] == reference[:3]
    rev = default_engine.generate(PROMPTS[::-1], GREEDY)
    assert [o.token_ids for o in rev][::-1] == reference
    assert_no_leak(default_engine)


def test_shared_long_prefix_is_reused_and_greedy_unchanged(default_engine):
    system = "You are a careful assistant. " * 40
    prompts = [system + q for q in ("Name a fruit.", "Name a color.", "Name a planet.", "Name an animal.")]
    with make_engine(disable_radix_cache=True) as cold:
        expected = [o.token_ids for o in cold.generate(prompts, GREEDY)]
    first = default_engine.generate(prompts[0], GREEDY)
    rest = default_engine.generate(prompts[1:], GREEDY)
    assert [first.token_ids] + [o.token_ids for o in rest] == expected
    shared = len(default_engine.tokenizer.encode(system))
    assert all(o.cached_tokens >= shared - 2 for o in rest), [o.cached_tokens for o in rest]
    assert_no_leak(default_engine)
