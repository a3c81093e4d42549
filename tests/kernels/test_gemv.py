"""The GEMV kernels (kernels/triton/gemv.py: one row, and 2..MAX_ROWS rows), the chunked greedy argmax
(kernels/triton/sampling.py), and the model's use of both (engine/models/layers.py Linear,
LlamaForCausalLM.compute_logits).

On CPU the kernels run under the Triton interpreter (small shapes); on a GPU they run compiled, with
programmatic dependent launch on Hopper, and the @pytest.mark.gpu tests add the Llama-3.1-8B shapes.

Tolerance: the kernel and the reference both sum in float32 and round once; only the summation order
differs, so fp32 agrees to ~1e-5 relative and bf16 / fp16 to one ulp of the output dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.triton import fix_interpreter_scalar_index  # noqa: E402
from kernels.triton.gemv import (  # noqa: E402
    MAX_ROWS,
    GemvConfig,
    RowsConfig,
    gemv,
    gemv_reference,
    gemv_silu_mul,
    pick_config,
    pick_rows_config,
)
from kernels.triton.fused_layers import silu_and_mul, silu_and_mul_reference  # noqa: E402
from kernels.triton.sampling import argmax  # noqa: E402

fix_interpreter_scalar_index()
GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
ULP = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-2),
    torch.float16: dict(rtol=2**-10, atol=1e-3),
}


def randn(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def tol(dtype):
    # the CPU interpreter truncates float32 -> bf16 where torch rounds: one more ulp there
    if not GPU and dtype == torch.bfloat16:
        return dict(rtol=2**-6, atol=2e-2)
    return ULP[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(40, 64, False), (37, 96, True), (16, 1024, False), (5, 40, True)])
def test_gemv_matches_reference(dtype, n, k, bias):
    """Rows that do not fill the last program (37, 5), K shorter than or not a multiple of the tile (96, 40)."""
    x = randn(1, k, dtype=dtype)
    w = randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=2) if bias else None
    y = gemv(x, w, b)
    assert y.shape == (1, n) and y.dtype == dtype
    torch.testing.assert_close(y, gemv_reference(x, w, b), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [(2, 40, 64, False), (3, 37, 96, True), (16, 16, 1024, False), (5, 5, 40, True)])
def test_gemv_rows_match_reference(dtype, m, n, k, bias):
    """2..MAX_ROWS rows (the rows kernel): partial programs (37, 5 rows of W), K not a multiple of the tile."""
    x = randn(m, k, dtype=dtype)
    w = randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=2) if bias else None
    y = gemv(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, gemv_reference(x, w, b), **tol(dtype))


@pytest.mark.parametrize(
    "cfg", [RowsConfig(16, 16, 1), RowsConfig(32, 64, 2), RowsConfig(16, 128, 4, 3), RowsConfig(16, 32, 4, 1, 4)]
)
def test_gemv_rows_tile_shapes(cfg):
    """K = 200: several tiles, a partial last one, and no even split (split-K falls back to one program)."""
    x = randn(4, 200, dtype=torch.float32)
    w = randn(50, 200, dtype=torch.float32, seed=1, scale=0.1)
    torch.testing.assert_close(gemv(x, w, config=cfg), gemv_reference(x, w), **ULP[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 4, 8])
def test_gemv_rows_split_k_is_deterministic_and_leaves_locks_free(dtype, split):
    """Split K: partials summed in split order by whichever program arrives last, so the same bits every
    launch; every arrival counter is back at zero afterwards (the next launch starts clean)."""
    from kernels.triton import gemv as gemv_module

    x = randn(5, 1024, dtype=dtype)
    w = randn(70, 1024, dtype=dtype, seed=1, scale=1024**-0.5)
    b = randn(70, dtype=dtype, seed=2)
    cfg = RowsConfig(16, 64, 4, 1, split)
    y = gemv(x, w, b, config=cfg)
    torch.testing.assert_close(y, gemv_reference(x, w, b), **tol(dtype))
    for _ in range(3):
        assert torch.equal(gemv(x, w, b, config=cfg), y)
    assert all(int(locks.abs().sum()) == 0 for locks in gemv_module._LOCKS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_do_not_depend_on_the_other_rows(dtype):
    """A row's result is the same bits whatever the batch around it (2..MAX_ROWS rows, any other values):
    a decode step padded to a CUDA graph's batch size rounds each request as the eager step does."""
    x = randn(MAX_ROWS, 256, dtype=dtype)
    w = randn(72, 256, dtype=dtype, seed=1, scale=0.1)
    full = gemv(x, w)
    for m in (2, 5, MAX_ROWS - 1):
        assert torch.equal(gemv(x[:m], w), full[:m]), m
    other = x.clone()
    other[1:] = randn(MAX_ROWS - 1, 256, dtype=dtype, seed=7)
    assert torch.equal(gemv(other, w)[0], full[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (8, 48, 512, RowsConfig(16, 64, 4, 3, 1)),  # 8 tiles per program
        (3, 40, 128, RowsConfig(16, 64, 4, 3, 1)),  # exactly 2 tiles: the loop body never runs
        (16, 64, 1024, RowsConfig(32, 64, 4, 3, 4)),  # split K: 4 tiles per split
        (5, 37, 200, RowsConfig(16, 32, 4, 3, 1)),  # a partial last tile: falls back to one tile ahead
        (4, 20, 64, RowsConfig(16, 64, 4, 3, 1)),  # a single tile: falls back
    ],
)
def test_gemv_rows_two_tiles_ahead_is_bit_identical(dtype, m, n, k, cfg):
    """prefetch=2 keeps two weight tiles in flight but sums the tiles in the same order: the same bits as
    prefetch=1, bias included; shapes it cannot serve (a partial tile, one tile) fall back to one ahead."""
    x = randn(m, k, dtype=dtype)
    w = randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=2)
    one = gemv(x, w, b, config=cfg)
    two = gemv(x, w, b, config=cfg._replace(prefetch=2))
    assert torch.equal(one, two)
    torch.testing.assert_close(two, gemv_reference(x, w, b), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,d,k,cfg",
    [
        (1, 20, 96, None),  # one row: pairs that do not fill the last program, a partial K tile
        (1, 64, 512, GemvConfig(8, 64, 4)),  # one row, several K tiles
        (5, 37, 200, None),  # the rows kernel, a partial K tile
        (8, 40, 512, RowsConfig(16, 64, 4, 3, 1, 2)),  # two tiles ahead
        (16, 32, 1024, RowsConfig(32, 64, 4, 3, 4)),  # split K: the last program's epilogue
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_silu_mul_is_the_two_kernels_bit_for_bit(dtype, m, d, k, cfg, bias):
    """One launch for silu(x @ gate^T) * (x @ up^T): the same bits as gemv, then silu_and_mul (each row summed
    in the same tile shape, rounded where the two kernels round), and close to the float32 reference."""
    x = randn(m, k, dtype=dtype)
    w = randn(2 * d, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(2 * d, dtype=dtype, seed=2) if bias else None
    y = gemv_silu_mul(x, w, b, config=cfg)
    assert y.shape == (m, d) and y.dtype == dtype
    assert torch.equal(y, silu_and_mul(gemv(x, w, b, config=cfg)))
    # against float32 math: a gate one ulp off (summation order) moves the product by up to |up| ulps
    ref = silu_and_mul_reference(gemv_reference(x.float(), w.float(), None if b is None else b.float()))
    close = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-5, atol=5e-2)
    torch.testing.assert_close(y.float(), ref, **close)


def test_gemv_silu_mul_vector_input_and_bad_shapes():
    x = randn(64, dtype=torch.bfloat16)
    w = randn(48, 64, dtype=torch.bfloat16, seed=1, scale=0.1)
    assert torch.equal(gemv_silu_mul(x, w), silu_and_mul(gemv(x, w)))
    assert gemv_silu_mul(x, w).shape == (24,)
    with pytest.raises(ValueError, match="gate"):
        gemv_silu_mul(x, w[:47])
    with pytest.raises(ValueError, match="columns"):
        gemv_silu_mul(randn(2, 63, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="pairs"):
        gemv_silu_mul(x, w, config=GemvConfig(1, 64, 1))


def test_gemv_rows_float32_logits_and_bad_row_counts():
    x = randn(3, 64, dtype=torch.bfloat16)
    w = randn(33, 64, dtype=torch.bfloat16, seed=1, scale=0.2)
    y = gemv(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, y.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="rows"):
        gemv(randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
    assert pick_rows_config(28672, 4096, torch.bfloat16).block_n >= 16  # a dot operand


def test_pick_rows_config_tiles():
    """The tiles bench_gemv --rows 8 --sweep chose for Llama-3.1-8B on an H100 and an H200, and small shapes
    fitted."""
    bf16 = torch.bfloat16
    assert pick_rows_config(6144, 4096, bf16) == RowsConfig(16, 256, 4, 3, 1)  # qkv
    assert pick_rows_config(4096, 4096, bf16) == RowsConfig(32, 128, 4, 3, 4)  # o
    assert pick_rows_config(28672, 4096, bf16) == RowsConfig(128, 128, 4, 3, 1)  # gate_up
    assert pick_rows_config(4096, 14336, bf16) == RowsConfig(32, 128, 4, 3, 4)  # down
    assert pick_rows_config(128256, 4096, bf16) == RowsConfig(128, 128, 4, 3, 1)  # lm_head
    assert pick_rows_config(5, 40, torch.float32) == RowsConfig(16, 64, 4, 3, 1)  # no even split of K = 40


@pytest.mark.parametrize("cfg", [GemvConfig(4, 16, 1), GemvConfig(8, 32, 2), GemvConfig(16, 64, 4)])
def test_gemv_tile_shapes_and_several_k_tiles(cfg):
    """Explicit tiles: K = 200 spans several tiles with a partial last one; N = 50 a partial last program."""
    x = randn(1, 200, dtype=torch.float32)
    w = randn(50, 200, dtype=torch.float32, seed=1, scale=0.1)
    torch.testing.assert_close(gemv(x, w, config=cfg), gemv_reference(x, w), **ULP[torch.float32])


def test_gemv_float32_logits_round_through_the_input_dtype():
    """out_dtype=float32 stores F.linear(x, w).float(): the bf16 result widened, not the float32 sum."""
    x = randn(1, 64, dtype=torch.bfloat16)
    w = randn(33, 64, dtype=torch.bfloat16, seed=1, scale=0.2)
    y = gemv(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, y.to(torch.bfloat16).float())  # every value is a bf16 value
    torch.testing.assert_close(y, gemv_reference(x, w).float(), **tol(torch.bfloat16))


def test_gemv_vector_input_and_bad_shapes():
    x = randn(64, dtype=torch.float32)
    w = randn(8, 64, dtype=torch.float32, seed=1)
    assert gemv(x, w).shape == (8,)
    with pytest.raises(ValueError, match="columns"):
        gemv(randn(1, 63, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(randn(1, 8, dtype=torch.float32), w.t())


def test_gemv_is_deterministic():
    """Same inputs, same bits: the tile (and so the summation order) is a function of the shape alone."""
    x = randn(1, 256, dtype=torch.bfloat16)
    w = randn(96, 256, dtype=torch.bfloat16, seed=1, scale=0.1)
    assert torch.equal(gemv(x, w), gemv(x, w))
    assert pick_config(96, 256, torch.bfloat16) == pick_config(96, 256, torch.bfloat16)


def test_pick_config_tiles():
    """The tiles bench_gemv --sweep chose for Llama-3.1-8B on an H100, and small shapes fitted."""
    bf16 = torch.bfloat16
    assert pick_config(6144, 4096, bf16) == GemvConfig(16, 512, 4)  # qkv
    assert pick_config(4096, 4096, bf16) == GemvConfig(8, 512, 8)  # o
    assert pick_config(28672, 4096, bf16) == GemvConfig(4, 1024, 4)  # gate_up
    assert pick_config(4096, 14336, bf16) == GemvConfig(4, 1024, 8)  # down
    assert pick_config(128256, 4096, bf16) == GemvConfig(4, 1024, 4)  # lm_head
    assert pick_config(4096, 4096, torch.float32).block_k == 256  # 1 KiB of each row per tile
    cfg = pick_config(5, 40, torch.float32)
    assert cfg == GemvConfig(8, 64, 4)  # one program covers all 5 rows


@pytest.mark.parametrize("bs,vocab", [(1, 5000), (3, 300), (2, 2048)])
def test_argmax_matches_torch(bs, vocab):
    logits = randn(bs, vocab, dtype=torch.float32)
    torch.testing.assert_close(argmax(logits), logits.argmax(dim=-1), rtol=0, atol=0)


def test_argmax_ties_take_the_lowest_index_across_chunks():
    """Maxima in several chunks: the first index wins, as torch.argmax; an all -inf row gives 0."""
    logits = torch.full((3, 5000), -1.0, device=DEVICE)
    logits[0, [4999, 2048, 3000]] = 7.0  # chunk 1 and 2 hold maxima; the lowest is 2048
    logits[1, [10, 11]] = 2.0
    logits[2] = float("-inf")
    assert argmax(logits, block=1024).tolist() == [2048, 10, 0]
    assert logits.argmax(dim=-1).tolist() == [2048, 10, 0]


def test_linear_uses_gemv_only_for_few_rows_on_cuda():
    from engine.models.layers import GEMV_MAX_ROWS, Linear, gemv_applies, set_gemv

    assert GEMV_MAX_ROWS == MAX_ROWS

    layer = Linear(64, 32, bias=True)
    x = torch.randn(1, 64)
    assert not gemv_applies(layer, x)  # CPU: F.linear
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    if GPU:
        layer = layer.to(device=DEVICE, dtype=torch.bfloat16)
        one, few, many = (torch.randn(m, 64, device=DEVICE, dtype=torch.bfloat16) for m in (1, MAX_ROWS, MAX_ROWS + 1))
        assert gemv_applies(layer, one) and gemv_applies(layer, few) and not gemv_applies(layer, many)
        assert not gemv_applies(layer, one.float())  # float32 stays on F.linear (batch invariance)
        set_gemv(layer, 1)  # EngineConfig.gemv_max_rows=1: batch-1 steps only
        assert gemv_applies(layer, one) and not gemv_applies(layer, few)
        set_gemv(layer, 0)
        assert not gemv_applies(layer, one)
    with pytest.raises(ValueError, match="max_rows"):
        set_gemv(layer, MAX_ROWS + 1)


def test_linear_takes_cublaslt_only_between_the_gemv_rows_and_its_bound():
    from engine.models.layers import CUBLASLT_MAX_ROWS, Linear, cublaslt_applies, set_cublaslt, set_gemv

    layer = Linear(64, 32, bias=True)
    x = torch.randn(CUBLASLT_MAX_ROWS, 64)
    assert not cublaslt_applies(layer, x)  # CPU: F.linear
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="max_rows"):
        set_cublaslt(layer, -1)
    if GPU:
        layer = layer.to(device=DEVICE, dtype=torch.bfloat16)
        rows = {m: torch.randn(m, 64, device=DEVICE, dtype=torch.bfloat16) for m in (MAX_ROWS, MAX_ROWS + 1, 64, 65)}
        assert [cublaslt_applies(layer, x) for x in rows.values()] == [False, True, True, False]
        assert not cublaslt_applies(layer, rows[64].float())  # float32 keeps torch's default path
        set_cublaslt(layer, 0)
        assert not any(cublaslt_applies(layer, x) for x in rows.values())
        set_cublaslt(layer, 64)
        set_gemv(layer, 0)  # no GEMV kernels: cuBLASLt from one row
        assert cublaslt_applies(layer, rows[MAX_ROWS])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 32, 64])
def test_gpu_linear_cublaslt_matches_f_linear_and_restores_the_setting(m):
    """The medium-batch path rounds like any cuBLAS product (float32 sums, one rounding) and leaves torch's
    process-wide BLAS preference as it found it."""
    from engine.models.layers import Linear, linear_cublaslt

    before = torch.backends.cuda.preferred_blas_library()
    x = randn(m, 4096, dtype=torch.bfloat16)
    w = randn(6144, 4096, dtype=torch.bfloat16, seed=1, scale=4096**-0.5)
    y = linear_cublaslt(x, w)
    assert torch.backends.cuda.preferred_blas_library() == before
    torch.testing.assert_close(y, gemv_reference(x, w), **ULP[torch.bfloat16])
    layer = Linear(4096, 6144, bias=False).to(device=DEVICE, dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    assert torch.equal(layer(x), y)
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_gpu_gemv_llama3_8b_shapes(n, k):
    """Llama-3.1-8B's decode products (qkv, o, gate_up, down, lm_head) against F.linear in bf16."""
    x = randn(1, k, dtype=torch.bfloat16)
    w = randn(n, k, dtype=torch.bfloat16, seed=1, scale=k**-0.5)
    y = gemv(x, w)
    torch.testing.assert_close(y, gemv_reference(x, w), **ULP[torch.bfloat16])
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), **ULP[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_gpu_gemv_rows_llama3_8b_shapes(m, n, k):
    """The rows kernel at Llama-3.1-8B's decode shapes against F.linear in bf16."""
    x = randn(m, k, dtype=torch.bfloat16)
    w = randn(n, k, dtype=torch.bfloat16, seed=1, scale=k**-0.5)
    y = gemv(x, w)
    torch.testing.assert_close(y, gemv_reference(x, w), **ULP[torch.bfloat16])
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), **ULP[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("d", [14336, 7168, 3584, 1792])  # Llama-3.1-8B's gate_up, and its shards under TP 2/4/8
@pytest.mark.parametrize("prefetch", [1, 2])
def test_gpu_gemv_silu_mul_llama3_8b_bit_for_bit(m, d, prefetch):
    """Compiled, the gated tile holds gate and up rows in alternate columns of the plain tile: the tensor-core
    dot (or the one-row reduction) must sum every column alike for the result to be the two kernels' bits."""
    x = randn(m, 4096, dtype=torch.bfloat16)
    w = randn(2 * d, 4096, dtype=torch.bfloat16, seed=1, scale=4096**-0.5)
    cfg = None if m == 1 else pick_rows_config(2 * d, 4096, torch.bfloat16)._replace(prefetch=prefetch)
    assert torch.equal(gemv_silu_mul(x, w, config=cfg), silu_and_mul(gemv(x, w, config=cfg)))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("k,d", [(576, 1536), (896, 4864), (2048, 8192)])  # small models' MLPs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemv_silu_mul_other_shapes_dtypes_and_bias(m, k, d, dtype):
    """Compiled, K not a multiple of the tile (576, 896), fp16 and a bias: still the two kernels' bits."""
    x = randn(m, k, dtype=dtype)
    w = randn(2 * d, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(2 * d, dtype=dtype, seed=2)
    assert torch.equal(gemv_silu_mul(x, w, b), silu_and_mul(gemv(x, w, b)))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,config", [(1, None), (8, None), (8, RowsConfig(16, 128, 4, 3, 4))])
def test_gpu_gemv_chain_in_a_cuda_graph(rows, config):
    """A chain of dependent products (each reads the previous one's output) captured in a CUDA graph and
    replayed: with programmatic dependent launch a kernel starts before its predecessor ends, so a missing
    wait would read stale inputs. The replay must equal the eager chain bit for bit."""
    ws = [randn(512, 512, dtype=torch.bfloat16, seed=i, scale=512**-0.5) for i in range(8)]
    x0 = randn(rows, 512, dtype=torch.bfloat16, seed=99)

    def chain(x):
        for w in ws:
            x = gemv(x, w, config=config)
        return x

    eager = chain(x0)
    static_x = x0.clone()
    chain(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = chain(static_x)
    for seed in (99, 5, 6):
        static_x.copy_(randn(rows, 512, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, chain(static_x.clone())), seed
    static_x.copy_(x0)
    graph.replay()
    assert torch.equal(static_y, eager)


def test_engine_config_bounds_gemv_max_rows():
    from engine.config import EngineConfig
    from engine.errors import InvalidConfigError

    assert EngineConfig().gemv_max_rows == MAX_ROWS
    for bad in (-1, MAX_ROWS + 1):
        with pytest.raises(InvalidConfigError, match="gemv_max_rows"):
            EngineConfig(gemv_max_rows=bad)
