"""PiecewiseGraphRunner's plumbing on CPU (pieces run eagerly through its static buffers): a prefill or mixed
step through the pieces gives the model's own forward, with and without padding to a token bucket, and
writes the same K/V. On CUDA (`-m gpu`): the captured pieces give the eager pieces' bits; the engine's
outputs with them: tests/engine/test_gpu_engine.py."""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.models.source import resolve_model
from engine.runner.model_runner import ModelRunner
from engine.runner.piecewise_graph import PiecewiseGraphRunner, token_buckets
from engine_harness import TINY_LLAMA, write_tiny_config

CONTEXT = 20  # cached tokens of each decoding request


def _tiny_runner(folder, family: str, model_overrides: Optional[dict] = None, **config) -> ModelRunner:
    """A ModelRunner of a tiny dummy model (Qwen3: q/k norms) whose KV pool is random."""
    qwen3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]) if family == "qwen3" else {}
    model = write_tiny_config(folder, **qwen3, **(model_overrides or {}))
    defaults = dict(load_format="dummy", skip_tokenizer_init=True, max_running_requests=16, max_total_tokens=4096)
    cfg = EngineConfig(model=model, **{**defaults, **config})
    torch.manual_seed(0)
    r = ModelRunner(cfg, resolve_model(model))
    gen = torch.Generator(device=r.device).manual_seed(0)
    for buf in r.kv_pool.k_buffers + r.kv_pool.v_buffers:
        buf.normal_(0.0, 1.0, generator=gen)
    return r


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runner(request, tmp_path_factory):
    """A float32 CPU ModelRunner of a tiny dummy model whose KV pool is random."""
    return _tiny_runner(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, dtype="float32", device="cpu")


def _batch(runner, decodes: int, prompt_lens):
    """An EXTEND batch: `decodes` requests with CONTEXT cached tokens decoding one token each, then one new
    prompt per entry of `prompt_lens` (no cached prefix). Fresh rows and slots each call."""
    ids, pos, rows, seq, pre, locs = [], [], [], [], [], []
    for i in range(decodes):
        row = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc_pages(CONTEXT + 1)
        runner.req_to_token_pool.write(row, 0, slots)
        ids.append(7 + i)
        pos.append(CONTEXT)
        rows.append(row)
        seq.append(CONTEXT + 1)
        pre.append(CONTEXT)
        locs.append(slots[CONTEXT:])
    for j, n in enumerate(prompt_lens):
        row = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc_pages(n)
        runner.req_to_token_pool.write(row, 0, slots)
        ids += [(11 * j + 3 * k) % 300 for k in range(n)]
        pos += list(range(n))
        rows.append(row)
        seq.append(n)
        pre.append(0)
        locs.append(slots)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, pos, torch.cat(locs), rows, seq, pre, runner.device)
    fb.attn_backend = runner.backend_for(fb)
    return fb


def _kv(pool):
    """(K, V) buffers of every layer of the tiny model."""
    return [pool.get_kv_buffer(layer) for layer in range(TINY_LLAMA["num_hidden_layers"])]


def test_token_buckets():
    assert token_buckets(512) == [8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert token_buckets(1) == [8] and token_buckets(100)[-2:] == [96, 100]
    sizes = token_buckets(2048)
    assert sizes[-3:] == [1792, 1920, 2048] and len(sizes) == 34
    assert all(b - a <= max(8, a // 4) for a, b in zip(sizes, sizes[1:]) if a >= 64)


@pytest.mark.parametrize(
    "decodes, prompt_lens",
    [(0, [8]), (0, [5]), (3, [17]), (4, [30, 9]), (2, [])],
    ids=["one-bucket", "padded", "mixed-padded", "two-prompts", "decodes-only"],
)
def test_pieces_give_the_forward_and_its_kv(runner, decodes, prompt_lens):
    """The same step through the model's forward and through the pieces (padded to a bucket unless the step
    fills one): equal hidden states, and equal K/V written at the step's slots in every layer."""
    pieces = PiecewiseGraphRunner(runner.model, 64, runner.device, runner.attn_backend, capture=False)
    fb = _batch(runner, decodes, prompt_lens)
    pool = runner.kv_pool
    with torch.inference_mode():
        fb.attn_backend.init_forward_metadata(fb)
        want = runner.model(fb).clone()
        kv_want = [(k[fb.out_cache_loc].clone(), v[fb.out_cache_loc].clone()) for k, v in _kv(pool)]
        for k, v in _kv(pool):  # the pieces must write these again
            k[fb.out_cache_loc] = 0
            v[fb.out_cache_loc] = 0
        fb.attn_backend.init_forward_metadata(fb)
        got = pieces.forward(fb)
    assert pieces.can_run(fb)
    kv_got = [(k[fb.out_cache_loc], v[fb.out_cache_loc]) for k, v in _kv(pool)]
    if pieces.padded_size(fb.num_tokens) == fb.num_tokens:  # the very same matmuls: the very same bits
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for got_kv, want_kv in zip(kv_got, kv_want) for a, b in zip(got_kv, want_kv))
    else:  # padded rows change the matmuls' row count, which may round differently
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv_got, kv_want, rtol=1e-5, atol=1e-5)


def test_padding_rows_store_their_kv_in_the_reserved_slot_only(runner):
    """The pieces store every row's K/V, padding rows included: those go to slot 0 (the page the allocator
    reserves for padding writes); no other slot than the step's own changes. A step planned on another
    backend than the one the pieces store with is refused."""
    pieces = PiecewiseGraphRunner(runner.model, 64, runner.device, runner.attn_backend, capture=False)
    fb = _batch(runner, 3, [17])  # 20 tokens in the 24 bucket: 4 padding rows
    assert pieces.padded_size(fb.num_tokens) > fb.num_tokens
    pool = runner.kv_pool
    for k, v in _kv(pool):  # an earlier step's padding rows wrote the same values there
        k[0] = 0
        v[0] = 0
    before = [(k.clone(), v.clone()) for k, v in _kv(pool)]
    with torch.inference_mode():
        fb.attn_backend.init_forward_metadata(fb)
        pieces.forward(fb)
    touched = set(fb.out_cache_loc.tolist()) | {0}
    for (k, v), (k0, v0) in zip(_kv(pool), before):
        changed = ((k != k0).flatten(1).any(1) | (v != v0).flatten(1).any(1)).nonzero().flatten().tolist()
        assert set(changed) <= touched and 0 in changed
    other = copy.copy(fb)
    other.attn_backend = copy.copy(runner.attn_backend)
    with pytest.raises(ValueError, match="attention backend"):
        pieces.forward(other)


def test_steps_beyond_the_largest_bucket_and_decode_steps_are_not_taken(runner):
    pieces = PiecewiseGraphRunner(runner.model, 16, runner.device, runner.attn_backend, capture=False)
    assert pieces.max_tokens == 16
    assert not pieces.can_run(_batch(runner, 0, [17]))
    assert pieces.can_run(_batch(runner, 0, [16]))
    decode = _batch(runner, 2, [])
    decode.forward_mode = ForwardMode.DECODE
    assert not pieces.can_run(decode)


def test_on_by_default_its_bound_checked_and_tensor_parallel_refused_by_the_runner(runner):
    from engine.errors import InvalidConfigError

    assert EngineConfig().enable_piecewise_cuda_graph
    EngineConfig(tensor_parallel_size=2)  # the default stays valid: such an engine runs those steps eagerly
    with pytest.raises(InvalidConfigError, match="piecewise_cuda_graph_max_tokens"):
        EngineConfig(piecewise_cuda_graph_max_tokens=4)
    assert runner.piecewise_runner is None  # CPU: prefill and mixed steps run eagerly
    own, runner.model.tp = runner.model.tp, object()  # a tensor-parallel model carries its group here
    try:
        with pytest.raises(ValueError, match="tensor parallelism"):
            PiecewiseGraphRunner(runner.model, 16, runner.device, runner.attn_backend, capture=False)
    finally:
        runner.model.tp = own


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def gpu_pieces(request, tmp_path_factory):
    """(runner, captured pieces, eager pieces) of a bf16 CUDA ModelRunner of a tiny model, built once per family
    (capturing is the slow part). Head dim 64 (Qwen3's config keeps its own 128): FlashInfer's Hopper prefill
    kernels take 64, 128 or 256."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    wider = dict(hidden_size=256, intermediate_size=512)
    folder = tmp_path_factory.mktemp(f"gpu-{request.param}")
    # The cases below share the runner and none frees its rows: room for all of them.
    gpu = dict(dtype="bfloat16", device="cuda", disable_cuda_graph=True, max_running_requests=64)
    runner = _tiny_runner(folder, request.param, wider, **gpu)
    captured = PiecewiseGraphRunner(runner.model, 128, runner.device, runner.attn_backend)
    eager = PiecewiseGraphRunner(runner.model, 128, runner.device, runner.attn_backend, capture=False)
    return runner, captured, eager


@pytest.mark.gpu
@pytest.mark.parametrize(
    "decodes, prompt_lens",
    [(0, [8]), (3, [17]), (4, [30, 9]), (5, [100]), (8, [56])],
    ids=["one", "mixed", "two", "bucket-112", "full-64"],
)
def test_gpu_captured_pieces_give_the_eager_pieces_bits(gpu_pieces, decodes, prompt_lens):
    """bf16 on CUDA: the same step through captured pieces and through the same pieces run eagerly (same
    kernels, same padded size) gives the same hidden states and the same K/V, bit for bit. What the graphs
    read and write between pieces (the static buffers, attention's output) is therefore where the eager
    pieces have it, in every bucket (graphs share one memory pool). A step that fills its bucket also gives
    the model's own forward, bit for bit."""
    runner, captured, eager = gpu_pieces
    fb = _batch(runner, decodes, prompt_lens)
    pool = runner.kv_pool
    with torch.inference_mode():
        results = []
        for pieces in (captured, eager, captured, None):  # captured again: a replay after other work
            for k, v in _kv(pool):
                k[fb.out_cache_loc] = 0
                v[fb.out_cache_loc] = 0
            fb.attn_backend.init_forward_metadata(fb)
            hidden = (runner.model(fb) if pieces is None else pieces.forward(fb)).clone()
            results.append((hidden, [(k[fb.out_cache_loc].clone(), v[fb.out_cache_loc].clone()) for k, v in _kv(pool)]))
    assert captured.graphs and not eager.graphs
    if captured.padded_size(fb.num_tokens) != fb.num_tokens:  # the model's forward multiplies fewer rows
        results.pop()
    for hidden, kv in results[1:]:
        assert torch.equal(hidden, results[0][0])
        assert all(torch.equal(a, b) for got, want in zip(kv, results[0][1]) for a, b in zip(got, want))
