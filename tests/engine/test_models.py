"""Model layer against Hugging Face transformers: tiny random configs of every family, and the default model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.models.loader import load_config, load_model
from engine.models.registry import get_model_class
from engine.models.source import ModelSource
from model_harness import GreedyHarness

CPU = torch.device("cpu")
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# name -> (config, max_shard_size for save_pretrained)
TINY_CONFIGS = {
    "llama3": (
        lambda: LlamaConfig(
            **TINY,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        None,
    ),
    "llama_tied_bias": (
        lambda: LlamaConfig(**TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        None,
    ),
    "mistral_sharded": (lambda: MistralConfig(**TINY, head_dim=16), "40KB"),
    "qwen2_yarn": (
        lambda: Qwen2Config(
            **TINY,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        ),
        None,
    ),
    "qwen3": (lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False), None),
}


def save_tiny_model(name: str, folder) -> torch.nn.Module:
    """Build the HF model with a fixed seed, perturb norms and biases off their init, save it; return it."""
    make_config, shard = TINY_CONFIGS[name]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config()).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    hf.save_pretrained(str(folder), **({"max_shard_size": shard} if shard else {}))
    return hf


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """name -> (HF model, ModelSource of its saved folder), built once per module."""
    out = {}
    for name in TINY_CONFIGS:
        folder = tmp_path_factory.mktemp(name)
        out[name] = (save_tiny_model(name, folder), ModelSource(name=name, folder=str(folder)))
    return out


def prompts_for(vocab: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 17, 11)]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("prefill_chunk", [None, 6])
def test_tiny_logits_match_hf(tiny_models, name, prefill_chunk):
    hf, source = tiny_models[name]
    config = load_config(source)
    model = load_model(source, config, "auto", torch.float32, CPU)
    prompts = prompts_for(config.vocab_size)
    res = GreedyHarness(model).generate(prompts, max_new_tokens=9, prefill_chunk=prefill_chunk)
    for prompt, pre, dec, out in zip(prompts, res.prefill_logits, res.decode_logits, res.output_ids):
        assert pre.shape == (len(prompt), config.vocab_size) and dec.shape == (8, config.vocab_size)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out])).logits[0].float()  # teacher-forced on our tokens
        torch.testing.assert_close(pre, ref[: len(prompt)], atol=1e-4, rtol=0)
        torch.testing.assert_close(dec, ref[len(prompt) : len(prompt) + 8], atol=1e-4, rtol=0)
        assert out == ref[len(prompt) - 1 : len(prompt) + 8].argmax(-1).tolist()


def test_sharded_and_tied_checkpoints_are_what_they_claim(tiny_models):
    folder = tiny_models["mistral_sharded"][1].folder
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    model = load_model(
        tiny_models["llama_tied_bias"][1],
        load_config(tiny_models["llama_tied_bias"][1]),
        "safetensors",
        torch.float32,
        CPU,
    )
    assert not hasattr(model, "lm_head")
    hf = tiny_models["llama_tied_bias"][0]
    assert "lm_head.weight" in hf.state_dict()  # a tied lm_head in a state dict is skipped
    model.load_weights(hf.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_and_run(tiny_models, dtype):
    hf, source = tiny_models["qwen3"]
    config = load_config(source)
    model = load_model(source, config, "safetensors", dtype, CPU)
    assert all(p.dtype == dtype for p in model.parameters())
    prompts = prompts_for(config.vocab_size)
    res = GreedyHarness(model).generate(prompts, max_new_tokens=3)
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[1]])).logits[0]
    assert res.prefill_logits[1].dtype == torch.float32 and torch.isfinite(res.decode_logits[1]).all()
    assert (res.prefill_logits[1] - ref).abs().max() < 0.1


def test_dummy_weights_real_shapes(tmp_path):
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    source = ModelSource(name="dummy", folder=str(tmp_path))  # empty folder: no file may be read
    model = load_model(source, config, "dummy", torch.float32, CPU, seed=3)
    hf_numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert sum(p.numel() for p in model.parameters()) == hf_numel
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (3, 6, 2, 16)
    assert model.model.norm.weight.eq(1).all()
    std = model.model.layers[0].self_attn.qkv_proj.weight.std().item()
    assert abs(std - config.initializer_range) < 0.005
    again = load_model(source, config, "dummy", torch.float32, CPU, seed=3)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    res = GreedyHarness(model).generate([[1, 2, 3]], max_new_tokens=2)
    assert len(res.output_ids[0]) == 2


def test_unknown_architecture(tmp_path):
    config = PretrainedConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(config)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    with pytest.raises(UnsupportedModelError):
        load_config(ModelSource(name="x", folder=str(tmp_path)))


def test_missing_paths(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_config(ModelSource(name="x", folder=str(tmp_path / "nope")))
    with pytest.raises(ModelNotFoundError):
        load_config(ModelSource(name="x", folder=str(tmp_path), gguf_file="nope.gguf"))
    config = LlamaConfig(**TINY)
    config.save_pretrained(str(tmp_path))  # config but no weights
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(
            ModelSource(name="x", folder=str(tmp_path)),
            load_config(ModelSource("x", str(tmp_path))),
            "auto",
            torch.float32,
            CPU,
        )


def test_incomplete_or_foreign_checkpoint_rejected(tiny_models):
    model = load_model(tiny_models["llama3"][1], load_config(tiny_models["llama3"][1]), "dummy", torch.float32, CPU)
    with pytest.raises(UnsupportedModelError, match="missing"):
        model.load_weights([])
    with pytest.raises(UnsupportedModelError, match="unexpected weight"):
        model.load_weights([("model.layers.0.self_attn.rotary.bogus", torch.zeros(1))])
    with pytest.raises(UnsupportedModelError, match="shape"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])


def test_gguf_is_converted_once_to_an_identical_hf_folder(tmp_path, monkeypatch):
    """The converted folder holds the GGUF file's exact dequantized tensors, its tokenizer (vocabulary, chat
    template, eos ids) and config; an incomplete folder left by a crash is replaced, a complete one is reused."""
    from safetensors import safe_open
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.models import gguf_folder
    from engine.models.gguf_folder import cached_gguf_name_map, converted_folder
    from engine.models.source import resolve_model
    from engine.tokenizer import Tokenizer, load_tokenizer

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    source = resolve_model(None)
    folder = gguf_folder._folder_for(source.gguf_path)
    os.makedirs(folder)
    open(os.path.join(folder, "model.safetensors"), "w").close()  # a crash mid-conversion: no COMPLETE
    assert converted_folder(source) == folder and os.path.isfile(os.path.join(folder, gguf_folder.COMPLETE))
    assert not [e for e in os.listdir(os.path.dirname(folder)) if e.startswith(".converting-")]

    config = load_config(source)
    with torch.device("meta"):
        names_model = AutoModelForCausalLM.from_config(config)
    with cached_gguf_name_map():
        direct = load_gguf_checkpoint(source.gguf_path, return_tensors=True, model_to_load=names_model)["tensors"]
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(direct)
        for name in direct:
            stored = f.get_tensor(name)
            assert stored.dtype == direct[name].dtype and torch.equal(stored, direct[name]), name

    hf = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file, local_files_only=True)
    tok = load_tokenizer(source)
    assert tok.hf.get_vocab() == hf.get_vocab() and tok.hf.chat_template == hf.chat_template
    assert tok.eos_token_ids == Tokenizer(hf, gguf_folder._gguf_eos_ids(source.gguf_path)).eos_token_ids == {2}
    for text in ["The capital of France is", "naïve café — 東京 🙂\n\tdef f(x):", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == list(hf.encode(text))

    mtime = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert converted_folder(source) == folder  # complete: read as is
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == mtime
