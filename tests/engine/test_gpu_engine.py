"""The engine on a GPU: greedy outputs under every attention backend, CUDA graphs on and off, and against
the CPU float32 path; KV pool sizing from free GPU memory. Every test here needs CUDA.

bf16: FlashInfer and Triton round attention differently (each is within bf16 tolerance of the float32
reference, test_gpu_kernels), and a bf16 model amplifies a one-ulp difference when two candidate tokens
are nearly tied, so across *backends* greedy outputs are compared token by token and must agree on nearly
all positions; for one backend, CUDA graphs on and off must give identical tokens (same kernels, same
split-K choice: see engine/runner/cuda_graph.py; the same batches: Engine.generate queues its prompts at
once). float32 (Triton, IEEE dots): the GPU must reproduce the CPU float32 engine token for token.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine_harness import PROMPTS, make_engine

pytestmark = pytest.mark.gpu
MAX_NEW = 32
# Largest logit difference between two bf16 runs of the default model that differ only in attention rounding
# (logits are O(10-30); bf16 keeps ~3 significant digits, and 30 layers compound the rounding; measured on an
# H200: max 1.2 while the tokens agree).
LOGIT_TOL = 2.0
# Where two bf16 runs first pick different tokens, the gap between the two candidates' logits (measured: at most
# 0.125, i.e. ties at bf16 resolution of logits ~16-32).
TIE_TOL = 0.5


def _generate(**kwargs):
    engine = make_engine(device="cuda", **kwargs)
    try:
        outs = engine.generate(PROMPTS, dict(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
        backend = engine.runner.attn_backend_name
        graphs = engine.runner.graph_runner is not None
        return [o.token_ids for o in outs], backend, graphs
    finally:
        engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


def _agreement(a, b) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def _first_divergence(a, b):
    return [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]


@pytest.fixture(scope="module")
def bf16_runs():
    pytest.importorskip("flashinfer")
    runs = {}
    for backend in ("flashinfer", "triton"):
        for graphs in (True, False):
            ids, name, has_graphs = _generate(
                dtype="bfloat16", attention_backend=backend, disable_cuda_graph=not graphs, triton_decode_max_bs=0
            )
            assert name == backend and has_graphs == graphs
            runs[(backend, graphs)] = ids
    return runs


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_gpu_cuda_graphs_do_not_change_greedy_outputs(bf16_runs, backend):
    on, off = bf16_runs[(backend, True)], bf16_runs[(backend, False)]
    assert on == off, f"first divergence per prompt: {_first_divergence(on, off)}"


def test_gpu_backends_diverge_only_at_near_ties_in_bf16(bf16_runs):
    """FlashInfer (each prompt-row kernel of EngineConfig.flashinfer_prefill), Triton and torch-native attention
    in bf16, each decoding greedily on its own: while their tokens agree, their logits agree within bf16 noise,
    and where they first pick different tokens the two candidates are nearly tied (under either backend's
    logits). That is the whole difference a bf16 greedy run may show between backends (the engine runs,
    bf16_runs, are reported for the record)."""
    from model_harness import GreedyHarness

    from engine.models.loader import load_config, load_model
    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer

    fi, tr = bf16_runs[("flashinfer", True)], bf16_runs[("triton", True)]
    print(
        f"engine, flashinfer vs triton (bf16): {_agreement(fi, tr):.1%} of tokens equal; "
        f"first divergence per prompt {_first_divergence(fi, tr)}"
    )
    source = resolve_model(None)
    model = load_model(source, load_config(source), "gguf", torch.bfloat16, torch.device("cuda"))
    prompts = [load_tokenizer(source).encode(p) for p in PROMPTS]
    variants = {"flashinfer": ("flashinfer", {}), "triton": ("triton", {}), "torch_native": ("torch_native", {})}
    hopper = torch.cuda.get_device_capability()[0] == 9
    for kind in ("paged-fa2", "paged-fa3", "ragged-fa2", "ragged-fa3"):
        if hopper or not kind.endswith("fa3"):  # FA3 runs on Hopper only
            variants[f"flashinfer {kind}"] = ("flashinfer", {"prefill": kind})
    runs = {
        name: GreedyHarness(model, max_len=128, max_reqs=len(prompts), backend=backend, backend_kwargs=kwargs).generate(
            prompts, MAX_NEW
        )
        for name, (backend, kwargs) in variants.items()
    }
    ref = runs["torch_native"]
    for name in [n for n in variants if n != "torch_native"]:
        res = runs[name]
        for i in range(len(prompts)):
            torch.testing.assert_close(res.prefill_logits[i][-1], ref.prefill_logits[i][-1], atol=LOGIT_TOL, rtol=0)
            ours, theirs = res.output_ids[i], ref.output_ids[i]
            first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            steps = len(ours) - 1 if first is None else first  # decode logits j predict token j + 1
            for j in range(steps):
                torch.testing.assert_close(res.decode_logits[i][j], ref.decode_logits[i][j], atol=LOGIT_TOL, rtol=0)
            if first is not None:
                logits = [
                    res.prefill_logits[i][-1] if first == 0 else res.decode_logits[i][first - 1],
                    ref.prefill_logits[i][-1] if first == 0 else ref.decode_logits[i][first - 1],
                ]
                a, b = ours[first], theirs[first]
                gaps = [abs(float(x[a] - x[b])) for x in logits]
                print(f"{name} vs torch_native, prompt {i}: first divergence at token {first}, logit gap {gaps}")
                assert min(gaps) <= TIE_TOL, (name, i, first, gaps)


def test_gpu_auto_backend_is_flashinfer_in_bf16():
    """bf16 on CUDA: FlashInfer, with the Triton backend for decode steps of up to 256 requests."""
    pytest.importorskip("flashinfer")
    from kernels.attention.triton import TritonAttnBackend

    engine = make_engine(device="cuda", dtype="bfloat16")
    try:
        runner = engine.runner
        assert runner.attn_backend_name == "flashinfer" and runner.graph_runner is not None
        triton = runner.triton_decode_backend
        assert isinstance(triton, TritonAttnBackend)
        assert [runner.decode_backend(bs) is triton for bs in (1, 9, 64, 256, 257)] == [True] * 4 + [False]
        assert all((b is triton) == (bs <= 256) for bs, b in runner.graph_runner.backends.items())
    finally:
        engine.shutdown()


def _tokens_with_graphs_on_and_off(prompts, params, check=None, **kwargs):
    """Greedy token ids of `prompts` from two bf16 engines built with `kwargs`, CUDA graphs on then off;
    `check(engine)` runs on each before it generates."""
    runs = []
    for graphs in (True, False):
        engine = make_engine(device="cuda", dtype="bfloat16", disable_cuda_graph=not graphs, **kwargs)
        try:
            if check is not None:
                check(engine)
            runs.append([o.token_ids for o in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
            gc.collect()
            torch.cuda.empty_cache()
    return runs


def test_gpu_small_decode_steps_switch_backends_alike_with_graphs_on_and_off():
    """FlashInfer with Triton decode for steps of up to 4 requests: requests of different lengths make the batch
    shrink from 8 to 1, so each run switches from FlashInfer to Triton decode mid-way, at the same step with
    CUDA graphs on and off (the choice follows the padded batch size): identical tokens."""
    pytest.importorskip("flashinfer")
    params = [dict(temperature=0.0, max_new_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]

    def check(engine):
        assert engine.runner.triton_decode_backend is not None

    on, off = _tokens_with_graphs_on_and_off(PROMPTS, params, check=check, triton_decode_max_bs=4)
    assert on == off, f"first divergence per prompt: {_first_divergence(on, off)}"


def test_gpu_decode_steps_above_gemv_rows_alike_with_graphs_on_and_off():
    """24 requests of different lengths: decode steps of 17-24 rows multiply through F.linear (cuBLAS), then,
    as requests finish, through the GEMV kernels. The CUDA graphs and the eager steps run the same kernels:
    identical tokens."""
    pytest.importorskip("flashinfer")
    prompts = [f"{p} ({i})" for i in range(3) for p in PROMPTS]
    params = [dict(temperature=0.0, max_new_tokens=6 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    on, off = _tokens_with_graphs_on_and_off(prompts, params)
    assert on == off, f"first divergence per prompt: {_first_divergence(on, off)}"


@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_float32_matches_cpu_float32(default_engine, graphs):
    """The default model in float32 (auto → Triton on CUDA) gives the CPU engine's greedy tokens."""
    cpu = default_engine.generate(PROMPTS, dict(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
    gpu, backend, has_graphs = _generate(dtype="float32", disable_cuda_graph=not graphs)
    assert backend == "triton" and has_graphs == graphs
    cpu_ids = [o.token_ids for o in cpu]
    assert gpu == cpu_ids, f"first divergence per prompt: {_first_divergence(gpu, cpu_ids)}"


def test_gpu_kv_pool_sized_from_free_memory():
    """No max_total_tokens: the pool takes what mem_fraction_static leaves after weights and activations."""
    sizes = {}
    gc.collect()  # what earlier tests of this process left in the caching allocator is not free memory
    torch.cuda.empty_cache()
    for frac in (0.3, 0.5):
        engine = make_engine(
            device="cuda", dtype="bfloat16", max_total_tokens=None, mem_fraction_static=frac, disable_cuda_graph=True
        )
        try:
            sizes[frac] = engine.stats().kv_total_tokens
            per_token = engine.runner.kv_pool.bytes_per_token(
                engine.runner.model.num_layers,
                engine.runner.model.num_kv_heads,
                engine.runner.model.head_dim,
                torch.bfloat16,
            )
        finally:
            engine.shutdown()
            del engine  # before the next engine measures free memory
            gc.collect()
            torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    # 20% more of the card goes to the pool, less rounding and what other processes took meanwhile
    grown = (sizes[0.5] - sizes[0.3]) * per_token
    assert 0.15 * total < grown < 0.21 * total, (sizes, per_token, total)


def test_gpu_clear_errors_when_it_does_not_fit(tmp_path):
    from transformers import LlamaConfig

    from engine.errors import OutOfMemoryError

    with pytest.raises(OutOfMemoryError, match="KV tokens"):
        make_engine(device="cuda", dtype="bfloat16", max_total_tokens=None, mem_fraction_static=0.01)
    huge = LlamaConfig(
        vocab_size=32000,
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=120,
        num_attention_heads=128,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    huge.save_pretrained(tmp_path)
    with pytest.raises(OutOfMemoryError, match="do not fit"):
        make_engine(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="bfloat16")
    gc.collect()
    torch.cuda.empty_cache()


def _overlap_run(overlap: bool, dtype: str, params):
    """Outputs (tokens, text, finish reason) of PROMPTS under `params` with overlap scheduling on or off;
    afterwards every KV page is free once the cache is dropped."""
    import time

    from engine_harness import assert_no_leak

    engine = make_engine(device="cuda", dtype=dtype, disable_overlap_schedule=not overlap)
    try:
        assert engine.runner.graph_runner is not None
        outs = [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(PROMPTS, params)]
        for _ in range(100):  # the dropped extra step of the last requests is processed at the next step
            if not engine._call(lambda: engine.scheduler.has_work):
                break
            time.sleep(0.01)
        assert_no_leak(engine)
        engine.flush_cache()
        stats = engine.stats()
        assert stats.kv_free_tokens == stats.kv_total_tokens, stats
        return outs
    finally:
        engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_overlap_schedule_does_not_change_outputs(dtype):
    """Overlap scheduling on and off, CUDA graphs on: identical outputs. bf16 (FlashInfer): greedy, every
    request the same length, so both runs decode the same batches. float32 (Triton, batch-composition
    invariant): different lengths, stop strings, EOS and seeded sampling in one batch."""
    if dtype == "bfloat16":
        pytest.importorskip("flashinfer")
        params = dict(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    else:
        params = [
            dict(temperature=0.0, max_new_tokens=40),  # EOS after 30 tokens
            dict(temperature=0.0, max_new_tokens=40, stop=["\n\n"]),
            dict(temperature=0.0, max_new_tokens=24, stop=["3."]),
            dict(temperature=0.0, max_new_tokens=1),
            dict(temperature=0.8, top_p=0.95, seed=7, max_new_tokens=MAX_NEW),
            dict(temperature=0.0, max_new_tokens=5),
            dict(temperature=0.0, max_new_tokens=MAX_NEW, logprobs=True, top_logprobs=2),
            dict(temperature=0.9, top_k=40, seed=11, max_new_tokens=17),
        ]
    on, off = _overlap_run(True, dtype, params), _overlap_run(False, dtype, params)
    assert on == off, f"first divergence per prompt: {_first_divergence([o[0] for o in on], [o[0] for o in off])}"


def test_gpu_planning_copies_do_not_synchronize():
    """Building a step's device inputs (ForwardBatch.build, ReqToTokenPool.write / write_positions, to_device)
    and the scheduler's KV bookkeeping (reading a request's slots, caching them in the radix tree, evicting and
    freeing pages) never wait for the device: overlap scheduling plans batch N+1 while batch N runs. CUDA's
    sync debug mode raises on any synchronizing call."""
    from engine.device_copy import to_device
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.memory.allocator import TokenToKVPoolAllocator
    from engine.memory.radix_cache import RadixCache
    from engine.memory.req_to_token import ReqToTokenPool

    device = torch.device("cuda")
    pool = ReqToTokenPool(size=4, max_context_len=64, device=device)
    allocator = TokenToKVPoolAllocator(num_pages=64, page_size=1)
    tree = RadixCache(allocator)
    busy = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):  # keep the device busy while the host plans
            busy = busy @ busy / 64
        pool.write(1, 0, torch.arange(5, 10))
        pool.write_positions(torch.tensor([1]), torch.tensor([5]), torch.tensor([10]))
        fb = ForwardBatch.build(
            ForwardMode.DECODE, [3, 4], [5, 6], torch.tensor([11, 12]), [1, 2], [6, 7], [5, 6], device
        )
        x = to_device(torch.tensor([1.5, 2.5]), device)
        slots = allocator.alloc_extend([0], [6], [-1])
        pool.write(2, 0, slots)
        tree.insert([1, 2, 3, 4, 5, 6], pool.read(2, 6))
        read = pool.read(1, 6)
        evicted = tree.evict(6)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert fb.input_ids.tolist() == [3, 4] and fb.out_cache_loc.tolist() == [11, 12] and x.tolist() == [1.5, 2.5]
    assert read.tolist() == [5, 6, 7, 8, 9, 10] and pool.req_to_token[1, :6].tolist() == [5, 6, 7, 8, 9, 10]
    assert evicted == 6 and allocator.available_size() == allocator.size


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_pdl_does_not_change_greedy_outputs(backend):
    """bf16, CUDA graphs on, the GEMV path for batch-1 steps: with programmatic dependent launch each of our
    kernels starts before its predecessor ends and must wait before reading; a missing wait would read stale
    activations. PDL on and off must give identical tokens, one prompt at a time (batch 1: the GEMV path),
    all prompts together, and in a batch of more than gemv_max_rows, whose decode graphs the engine captures
    without PDL (ModelRunner.decode_uses_pdl) after the smaller ones' with it."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    params = dict(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    runs = {}
    for disable_pdl in (False, True):
        engine = make_engine(device="cuda", dtype="bfloat16", attention_backend=backend, disable_pdl=disable_pdl)
        try:
            assert engine.runner.graph_runner is not None
            alone = [engine.generate(p, params).token_ids for p in PROMPTS[:3]]
            together = [o.token_ids for o in engine.generate(PROMPTS, params)]
            wide = [o.token_ids for o in engine.generate(PROMPTS * 3, params)]
            runs[disable_pdl] = (alone, together, wide)
        finally:
            engine.shutdown()
            gc.collect()
            torch.cuda.empty_cache()
    assert runs[False] == runs[True]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_core_process_gives_the_thread_core_outputs(dtype):
    """The server's engine (core in its own process, which owns the GPU) runs the same kernels on the same
    batches as the core in a thread: identical tokens, text and finish reasons, no leaked page."""
    from engine_harness import assert_no_leak

    params = dict(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    runs = []
    for core_process in (False, True):
        engine = make_engine(device="cuda", dtype=dtype, core_process=core_process)
        try:
            runs.append([(o.token_ids, o.text, o.finish_reason) for o in engine.generate(PROMPTS, params)])
            assert_no_leak(engine)
        finally:
            engine.shutdown()
            gc.collect()
            torch.cuda.empty_cache()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("piecewise", [False, True], ids=["eager", "piecewise-graphs"])
def test_gpu_mixed_steps_do_not_change_float32_outputs(default_engine, piecewise):
    """float32, Triton: prompts arriving while others decode (the decode rows then run through the extend
    kernels of a mixed step) give the CPU float32 engine's tokens, also when those steps replay piecewise
    CUDA graphs (every prefill and mixed step here is small enough to)."""
    from test_mixed_chunk import GREEDY, _staggered

    want = {p: o.token_ids for p, o in zip(PROMPTS, default_engine.generate(PROMPTS, GREEDY))}
    engine = make_engine(
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        enable_mixed_chunk=True,
        enable_piecewise_cuda_graph=piecewise,
    )
    try:
        pieces = engine.runner.piecewise_runner
        assert (pieces is not None) == piecewise
        used = []
        if pieces is not None:
            forward = pieces.forward
            pieces.forward = lambda fb: used.append(fb.num_tokens) or forward(fb)
            assert len(pieces.graphs) == len(pieces.buckets) * pieces.num_pieces
        got, mixed = _staggered(engine, every=3)
    finally:
        engine.shutdown()
    assert mixed > 0 and got == want
    assert bool(used) == piecewise
