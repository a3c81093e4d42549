"""engine/core/warmup.py: the start-up warm-up runs real steps and leaves no trace."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.config import EngineConfig
from engine.core import warmup
from engine.core.core import EngineCore
from engine.models.source import resolve_model
from engine_harness import assert_no_leak, make_engine, write_tiny_config


def _core(folder, **overrides) -> EngineCore:
    config = EngineConfig.from_kwargs(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        max_total_tokens=8192,
        enable_mixed_chunk=True,
        enable_cache_events=True,
        **overrides,
    )
    return EngineCore(config, resolve_model(folder))


def test_warm_up_runs_an_eager_prefill_and_a_mixed_step_over_a_cached_prefix_then_clears_everything(
    tmp_path, monkeypatch
):
    core = _core(write_tiny_config(tmp_path))
    try:
        seen = {}
        reset = core.scheduler.reset_stats

        def spy():
            seen.update(core.scheduler.counters, hit=core.tree_cache.stats.matched_tokens)
            reset()

        monkeypatch.setattr(core.scheduler, "reset_stats", spy)
        sizes = []
        launch = core.runner.launch_batch

        def launch_spy(batch, steps=None):
            sizes.append(batch.forward_batch.num_tokens)
            return launch(batch, steps)

        monkeypatch.setattr(core.runner, "launch_batch", launch_spy)
        assert warmup.warm_up(core) > 0
        assert sizes[0] == 600 and 640 in sizes  # eager steps of both kinds (T % 16 != 0, == 0)
        assert set(sizes) <= {600, 640, 1, 2, 3}  # and decodes
        assert seen["prefill_steps"] >= 2 and seen["mixed_steps"] >= 1  # B and C beside A's decode
        assert seen["cached_tokens"] >= warmup.PROMPT_TOKENS  # B reused A's prompt from the radix cache
        assert seen["generated_tokens"] == 12 and seen["finished"] == 3
        stats = core.call_stats()
        assert all(getattr(stats, k) == 0 for k in core.scheduler.counters), stats
        assert stats.cache_hit_rate == 0 and stats.device_wait_s == 0 and core.tree_cache.stats.matched_tokens == 0
        assert stats.kv_free_tokens == stats.kv_total_tokens and stats.kv_cached_tokens == 0
        assert core.call_drain_cache_events() == []  # a router never hears of the warm-up prompts
        assert core.take_outputs() == []  # nothing for a front end
    finally:
        core.close()


def test_warm_up_fits_a_short_context(tmp_path):
    core = _core(write_tiny_config(tmp_path, max_position_embeddings=96))
    try:
        warmup.warm_up(core)
        assert core.call_stats().kv_free_tokens == core.call_stats().kv_total_tokens
    finally:
        core.close()


def test_warm_up_is_for_cuda_only_and_servers_want_it():
    from serving.__main__ import SERVER_DEFAULTS

    assert SERVER_DEFAULTS["warmup"] is True and EngineConfig().warmup is False
    assert not warmup.wanted(EngineConfig(warmup=True), torch.device("cpu"))
    assert warmup.wanted(EngineConfig(warmup=True), torch.device("cuda"))
    assert not warmup.wanted(EngineConfig(), torch.device("cuda"))


def test_greedy_outputs_after_a_warm_up_are_those_of_a_cold_engine(tmp_path, monkeypatch):
    folder = write_tiny_config(tmp_path)
    prompts = [[(5 * i + j) % 300 for j in range(20 + 7 * i)] for i in range(6)]
    params = dict(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    kwargs = dict(model=folder, load_format="dummy", skip_tokenizer_init=True, enable_mixed_chunk=True)
    cold = make_engine(**kwargs)
    try:
        expected = [o.token_ids for o in cold.generate(prompts, params)]
    finally:
        cold.shutdown()
    monkeypatch.setattr(warmup, "wanted", lambda config, device: config.warmup)  # the CPU too
    warm = make_engine(warmup=True, **kwargs)
    try:
        stats = warm.stats()
        assert stats.prompt_tokens == 0 and stats.kv_free_tokens == stats.kv_total_tokens  # warmed, no trace
        assert [o.token_ids for o in warm.generate(prompts, params)] == expected
        assert_no_leak(warm)
    finally:
        warm.shutdown()


@pytest.mark.gpu
def test_gpu_warm_up_leaves_greedy_outputs_and_counters_as_a_cold_engine():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from engine_harness import PROMPTS

    params = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    runs = []
    for flag in (False, True):
        engine = make_engine(device="cuda", dtype="bfloat16", enable_mixed_chunk=True, warmup=flag)
        try:
            stats = engine.stats()
            assert stats.prompt_tokens == 0 and stats.device_busy_s == 0
            assert stats.kv_free_tokens == stats.kv_total_tokens
            runs.append([o.token_ids for o in engine.generate(PROMPTS, params)])
        finally:
            engine.shutdown()
            torch.cuda.empty_cache()
    assert runs[0] == runs[1]


def _triton_kernels():
    """Every Triton kernel of kernels/triton (module-level JIT functions)."""
    import importlib
    import pkgutil

    import triton

    import kernels.triton as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"kernels.triton.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, triton.runtime.jit.JITFunction)]
    return found


@pytest.mark.gpu
def test_gpu_steps_after_the_warm_up_compile_no_triton_kernel():
    """Triton compiles a kernel once per specialization of its arguments (an integer equal to 1, a pointer
    16-byte aligned or not). After the warm-up, mixed steps with so many decode rows that each gets a
    single KV split, with odd and even decode-row counts and batch sizes (the alignments of the batch views
    the kernels read), must find every Triton kernel compiled: a compile there would stall serving."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from engine.request import Req
    from engine.sampling_params import SamplingParams
    from kernels.triton import decode_attention as dec

    config = EngineConfig.from_kwargs(
        device="cuda", dtype="bfloat16", enable_mixed_chunk=True, skip_tokenizer_init=True, max_total_tokens=16384
    )
    core = EngineCore(config, resolve_model(None))
    try:
        warmup.warm_up(core)
        device = torch.device("cuda", torch.cuda.current_device())
        kernels = _triton_kernels()

        def variants():
            return {f"{k.fn.__module__}.{k.fn.__qualname__}": len(k.device_caches[device.index][0]) for k in kernels}

        compiled = variants()
        assert compiled["kernels.triton.decode_attention._decode_stage1"], compiled  # run by the warm-up
        cfg = core.runner.model_config
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        rows = -(-2 * sms // hkv) + 1  # enough decode rows for one split each, even at long contexts
        assert dec.pick_num_kv_splits(rows, hkv, 4096, device) == 1
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        done, count = [], itertools.count()

        def req(n):
            i = next(count)
            ids = [(3 + 7 * i + j) % 1000 for j in range(n)]
            return Req(f"r{i}", ids, params, seed=i, eos_token_ids=frozenset(), on_output=done.append)

        for decoders, prompts in ((rows, 1), (rows + 1, 1), (rows, 2), (rows + 1, 2)):
            decoding = [req(16) for _ in range(decoders)]
            for r in decoding:
                core.scheduler.add_request(r)
            while not all(r.output_ids for r in decoding):
                core.scheduler.step()
            mixed = core.scheduler.counters["mixed_steps"]
            for r in [req(64) for _ in range(prompts)]:  # prefilled beside the decode rows
                core.scheduler.add_request(r)
            while core.scheduler.has_work:
                core.scheduler.step()
            assert core.scheduler.counters["mixed_steps"] > mixed, (decoders, prompts)
            assert variants() == compiled, (decoders, prompts)
        stats = core.call_stats()
        assert stats.kv_free_tokens + stats.kv_evictable_tokens == stats.kv_total_tokens
    finally:
        core.close()
