"""An engine without a tokenizer (skip_tokenizer_init): token ids in and out, on a tiny random
Llama saved as safetensors (greedy equals transformers) and on dummy weights from a bare config."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine_harness import assert_no_leak, make_engine
from engine import InvalidRequestError

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=299,
    bos_token_id=1,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf


def test_token_ids_in_and_out_match_transformers(tiny_folder):
    folder, hf = tiny_folder
    prompts = [[5, 17, 42, 8, 9, 100], [7, 7, 7], list(range(10, 50))]
    with make_engine(
        model=str(folder), skip_tokenizer_init=True, max_total_tokens=1024, page_size=4, chunked_prefill_size=8
    ) as engine:
        outs = engine.generate(prompts, dict(temperature=0, max_new_tokens=12, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                ref = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=12,
                    min_new_tokens=12,
                    pad_token_id=0,
                )[0, len(prompt) :].tolist()
            assert out.token_ids == ref and out.text == ""
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            engine.generate("text needs a tokenizer", dict(max_new_tokens=1))
        with pytest.raises(InvalidRequestError, match="need a tokenizer"):
            engine.generate([5, 6], dict(max_new_tokens=1, stop=["x"]))
        assert_no_leak(engine)


def test_dummy_weights_from_a_bare_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with make_engine(
        model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_total_tokens=512
    ) as engine:
        outs = engine.generate([[1, 2, 3], [4, 5]], dict(temperature=0.8, seed=3, max_new_tokens=6, ignore_eos=True))
        assert [o.completion_tokens for o in outs] == [6, 6]
        assert all(0 <= t < TINY["vocab_size"] for o in outs for t in o.token_ids)


def test_context_is_capped_at_a_sliding_window(tmp_path):
    """Attention is full, so a sliding-window model (Mistral) is only exact within its window."""
    config = {**TINY, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
    config.pop("rope_scaling")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with make_engine(
        model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_total_tokens=512
    ) as engine:
        assert engine.context_len == 64
        out = engine.generate([[1, 2, 3]], dict(temperature=0, max_new_tokens=100, ignore_eos=True))[0]
        assert out.finish_reason == "length" and 3 + out.completion_tokens == 64


def test_tokenizer_option_gives_dummy_weights_a_tokenizer(tmp_path):
    """`tokenizer=` lends another model's tokenizer (here the default model's) to dummy weights of an
    architecture config; a tokenizer larger than the model's vocabulary is refused at start-up."""
    from engine import InvalidConfigError

    config = dict(TINY, vocab_size=49152, model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with make_engine(
        model=str(tmp_path), load_format="dummy", tokenizer="SmolLM2-135M-Instruct", max_total_tokens=1024
    ) as engine:
        out = engine.generate("Hello there", dict(max_new_tokens=5, ignore_eos=True))
        assert out.completion_tokens == 5 and out.prompt_tokens == len(engine.tokenizer.encode("Hello there"))
        assert_no_leak(engine)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, vocab_size=300)))
    with pytest.raises(InvalidConfigError, match="vocabulary"):
        make_engine(model=str(tmp_path), load_format="dummy", tokenizer="SmolLM2-135M-Instruct", max_total_tokens=1024)
