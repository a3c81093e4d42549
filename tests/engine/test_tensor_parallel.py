"""Tensor parallelism on the CPU (gloo): TP=2 gives the greedy tokens of TP=1, and a dead rank ends the engine.

The sharding arithmetic and the weights each rank loads are checked in-process on a tiny config (no group);
the engines run the default model in float32 with rank 1 in a process of its own. One TP=2 engine per page
size: chunked prefill (a prompt longer than the chunk), raw and chat prompts and a radix-cache hit share it.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from transformers import LlamaConfig

from engine.errors import EngineDeadError, InvalidConfigError, TensorParallelError
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.models.source import ModelSource
from engine.parallel.shard import HeadShard, head_shard, split_range, vocab_shard
from engine_harness import PROMPTS, assert_no_leak, make_engine

GREEDY = {"temperature": 0, "max_new_tokens": 8}
CHUNK = 32
"""chunked_prefill_size of the TP=2 engines: the long prompt takes several chunks."""
LONG = " ".join(PROMPTS)


# ---- sharding, in-process ------------------------------------------------------------------------------
def test_head_shards():
    # SmolLM2-135M over 2 ranks: whole GQA groups (3 KV heads of 3 query heads each), 2 + 1.
    assert [head_shard(9, 3, r, 2) for r in range(2)] == [HeadShard(0, 6, 0, 2), HeadShard(6, 9, 2, 3)]
    # Fewer KV heads than ranks: each KV head is replicated, its query heads split.
    assert [head_shard(8, 1, r, 2) for r in range(2)] == [HeadShard(0, 4, 0, 1), HeadShard(4, 8, 0, 1)]
    assert [head_shard(4, 2, r, 4) for r in range(4)] == [
        HeadShard(0, 1, 0, 1),
        HeadShard(1, 2, 0, 1),
        HeadShard(2, 3, 1, 2),
        HeadShard(3, 4, 1, 2),
    ]
    for heads, kv_heads, size in [(4, 2, 3), (4, 1, 8)]:
        with pytest.raises(InvalidConfigError):
            head_shard(heads, kv_heads, 0, size)


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts():
    from engine.config import EngineConfig
    from engine.models.source import resolve_model
    from engine.runner.model_runner import ModelRunner

    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=64, tensor_parallel_size=4)
    with pytest.raises(InvalidConfigError, match="cannot split 9 attention heads"):
        ModelRunner(config, resolve_model(None))  # SmolLM2-135M: 3 KV heads over 4 ranks


def test_ranges_cover_everything_once():
    for n, parts in [(1536, 2), (100, 3), (7, 4)]:
        ranges = [split_range(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for vocab, size in [(49152, 2), (101, 2), (9, 4)]:
        shards = [vocab_shard(vocab, r, size) for r in range(size)]
        assert sum(s.num_valid for s in shards) == vocab
        assert all(s.start == r * s.padded for r, s in enumerate(shards) if s.num_valid)


class _Rank:
    """A rank's place in a group, without the group: enough to build and load a shard."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _tiny_config() -> LlamaConfig:
    # Uneven everywhere over 2 ranks: 9 heads / 3 KV heads, 100 MLP columns, 101 vocabulary rows; biases.
    return LlamaConfig(
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        intermediate_size=100,
        vocab_size=101,
        num_hidden_layers=2,
        max_position_embeddings=64,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )


def _load(config, tp=None, folder="/nonexistent", fmt="dummy") -> LlamaForCausalLM:
    source = ModelSource(name="tiny", folder=folder)
    return load_model(source, config, fmt, torch.float32, torch.device("cpu"), seed=3, tp=tp)


def _assert_shards_make_up(full: LlamaForCausalLM, ranks: list) -> None:
    """Put every rank's parameters back together and compare them with the unsharded model's."""
    layer = "model.layers.1."
    f, shards = dict(full.named_parameters()), [dict(r.named_parameters()) for r in ranks]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = [s[name][: vocab_shard(101, r, 2).num_valid] for r, s in enumerate(shards)]
        assert torch.equal(torch.cat(rows), f[name])
        assert not shards[1][name][50:].any()  # padding
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[layer + name] for s in shards], dim=1), f[layer + name])
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        assert torch.equal(shards[0][layer + name], f[layer + name]) and layer + name not in shards[1]
    for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        for kind in ("weight", "bias"):
            name = f"{layer}{fused}.{kind}"
            parts = [dict(m.checkpoint_tensors(name, m.get_parameter(name))) for m in ranks]
            for hf, whole in full.checkpoint_tensors(name, f[name]):
                assert torch.equal(torch.cat([p[hf] for p in parts]), whole), hf
    assert torch.equal(shards[1][layer + "input_layernorm.weight"], f[layer + "input_layernorm.weight"])


def test_dummy_shards_make_up_the_tp1_dummy_weights():
    config = _tiny_config()
    full = _load(config)
    _assert_shards_make_up(full, [_load(config, _Rank(r, 2)) for r in range(2)])


def test_safetensors_shards_read_slices(tmp_path):
    from safetensors.torch import save_file

    config = _tiny_config()
    full = _load(config)
    tensors = {}
    for name, param in full.named_parameters():
        tensors.update((hf, t.contiguous()) for hf, t in full.checkpoint_tensors(name, param))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ranks = [_load(config, _Rank(r, 2), folder=str(tmp_path), fmt="safetensors") for r in range(2)]
    _assert_shards_make_up(full, ranks)


# ---- engines: TP=2 against TP=1 ----------------------------------------------------------------------
def _cases(tokenizer) -> tuple:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}])
    assert len(tokenizer.encode(LONG)) > 2 * CHUNK
    return PROMPTS[:4] + [PROMPTS[6], chat, LONG], LONG + " In short,"


def _run(engine) -> tuple:
    """Token ids of the batch of cases, then of the prompt that shares the long prompt's prefix, and that
    request's cached tokens."""
    batch, shared = _cases(engine.tokenizer)
    outs = engine.generate(batch, GREEDY)
    hit = engine.generate(shared, GREEDY)
    return [o.token_ids for o in outs] + [hit.token_ids], hit.cached_tokens


@pytest.fixture(scope="module")
def reference(default_engine):
    return _run(default_engine)[0]


@pytest.fixture(scope="module")
def tp_engine():
    """A TP=2 engine (page size 1) in this process, shared by the page-size-1 comparison and the failure test."""
    engine = make_engine(tensor_parallel_size=2, chunked_prefill_size=CHUNK)
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_tp2_page16_matches_tp1(reference):
    engine = make_engine(tensor_parallel_size=2, page_size=16, chunked_prefill_size=CHUNK)
    try:
        tokens, cached = _run(engine)
        assert tokens == reference
        assert cached >= 16  # the long prompt's pages
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_tp2_page1_matches_tp1(reference, tp_engine):
    tokens, cached = _run(tp_engine)
    assert tokens == reference
    assert cached > 0
    assert_no_leak(tp_engine)


@pytest.mark.slow
def test_tp2_logprobs_and_seeded_sampling_match_tp1(default_engine, tp_engine):
    """Prompt logprobs (rank 0's extra compute_logits calls, which rank 1 joins) and sampling on rank 0."""
    params = [
        {"temperature": 0, "max_new_tokens": 4, "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 2},
        {"temperature": 0.8, "seed": 5, "max_new_tokens": 8},
    ]
    tp1, tp2 = (engine.generate(PROMPTS[:2], params) for engine in (default_engine, tp_engine))
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]
    for key in ("logprobs", "prompt_logprobs"):
        ours, theirs = getattr(tp2[0], key), getattr(tp1[0], key)
        assert [t.token_id for t in ours] == [t.token_id for t in theirs]
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-4)


@pytest.mark.slow
def test_rank_failure_ends_the_engine(tp_engine):
    """Rank 1 is killed while a request decodes: the request and the engine end with TensorParallelError."""
    runner = tp_engine.local_core.runner
    pid = runner.tp.processes.pids[0]
    result: dict = {}
    started = threading.Event()

    def generate():
        try:
            stream = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}
            started.set()
            tp_engine.generate(PROMPTS[3], stream)
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            result["error"] = exc

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    started.wait()
    while tp_engine.stats().running == 0:  # decoding
        pass
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)  # a guard against a hang, not a speed requirement
    assert not thread.is_alive(), "the request did not end after its rank died"
    error = result.get("error")
    assert isinstance(error, TensorParallelError), repr(error)
    assert "rank 1" in str(error) and str(pid) in str(error)
    with pytest.raises(EngineDeadError):
        tp_engine.generate("Hello", GREEDY)
    assert runner.tp is None  # the engine left the group
