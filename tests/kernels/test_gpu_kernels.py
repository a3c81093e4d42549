"""Fused layer kernels (kernels/triton/fused_layers.py) against their torch references, and the FlashInfer
attention backend against TorchNativeAttnBackend.

The fused-layer tests run everywhere: compiled on a GPU, under the Triton interpreter on CPU (small shapes).
The FlashInfer tests are @pytest.mark.gpu and also skip where flashinfer is not installed.

Tolerances: fp32 kernels compute what torch computes in the same order except the mean of squares (a tree
sum): 1e-5 relative. bf16: the same roundings as torch, so results differ by at most one bf16 ulp where a
float32 intermediate lands on the other side of a rounding boundary (2 ** -7 relative). Attention in bf16
against the float32-accumulating reference: as in test_triton_kernels (P is rounded to bf16 before P @ V).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.forward_batch import ForwardMode  # noqa: E402
from kernels.triton import fix_interpreter_scalar_index  # noqa: E402
from kernels.triton import fused_layers as fl  # noqa: E402

fix_interpreter_scalar_index()
GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
# (rows, width) per device: CPU interpreter shapes stay tiny
ROWS, WIDTH = (300, 4096) if GPU else (5, 48)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-2)}


def randn(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def interp_bf16(dtype) -> bool:
    """The CPU interpreter truncates float32 -> bf16 where torch rounds: allow one more ulp there."""
    return not GPU and dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(dtype, with_residual):
    x = randn(ROWS, WIDTH, dtype=dtype) * 3
    w = randn(WIDTH, dtype=dtype, seed=1)
    eps = 1e-5
    if with_residual:
        r = randn(ROWS, WIDTH, dtype=dtype, seed=2)
        y, s = fl.fused_add_rmsnorm(x, r, w, eps)
        s_ref = x + r
        exact = dict(rtol=2**-7, atol=0) if interp_bf16(dtype) else dict(rtol=0, atol=0)
        torch.testing.assert_close(s, s_ref, **exact)
        ref = fl.rmsnorm_reference(s_ref, w, eps)
    else:
        y = fl.rmsnorm(x, w, eps)
        ref = fl.rmsnorm_reference(x, w, eps)
    tol = dict(rtol=2**-6, atol=2e-2) if interp_bf16(dtype) else TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = randn(ROWS, 2 * WIDTH, dtype=dtype) * 2
    tol = dict(rtol=2**-6, atol=2e-2) if interp_bf16(dtype) else TOL[dtype]
    torch.testing.assert_close(fl.silu_and_mul(x).float(), fl.silu_and_mul_reference(x).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_rope_on_qkv_views(dtype, heads, kv_heads, head_dim):
    from transformers import LlamaConfig

    from engine.models.layers import RotaryEmbedding

    T = 37
    qkv = randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    config = LlamaConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=500000.0
    )
    rotary = RotaryEmbedding(config, head_dim)
    positions = torch.randint(0, 5000, (T,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    qo, ko = fl.rope(q, k, cos, sin)
    assert qo.is_contiguous() and ko.is_contiguous()
    tol = dict(rtol=2**-6, atol=2e-2) if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(qo.float(), fl.rope_reference(q, cos[:, 0], sin[:, 0]).float(), **tol)
    torch.testing.assert_close(ko.float(), fl.rope_reference(k, cos[:, 0], sin[:, 0]).float(), **tol)
    # and the torch path of the model (rounding after each op) agrees within bf16 rounding
    torch.testing.assert_close(qo.float(), RotaryEmbedding.apply(q, cos, sin).float(), **tol)


def test_build_kv_indices():
    gen = torch.Generator().manual_seed(0)
    r2t = torch.randint(1, 10**6, (6, 700), generator=gen, dtype=torch.int32).to(DEVICE)
    rows = torch.tensor([4, 0, 5], device=DEVICE)
    lens = [600, 1, 513]
    indptr = torch.tensor([0, 600, 601, 1114], dtype=torch.int32, device=DEVICE)
    out = torch.full((1114,), -1, dtype=torch.int32, device=DEVICE)
    fl.build_kv_indices(r2t, rows, torch.tensor(lens, device=DEVICE), indptr, out)
    ref = torch.cat([r2t[r, :n] for r, n in zip(rows.tolist(), lens)])
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------ FlashInfer (GPU)


def test_flashinfer_mixed_step_split():
    """The leading one-token requests of an EXTEND batch go to the decode kernels; the rest to the prefill
    wrapper (a one-token request after a prompt stays with the prefill wrapper)."""
    from kernels.attention.flashinfer import _leading_one_token_requests

    assert _leading_one_token_requests([1, 1, 1000, 1]) == 2
    assert _leading_one_token_requests([1, 1]) == 2
    assert _leading_one_token_requests([7, 1]) == 0
    assert _leading_one_token_requests([]) == 0


def _flashinfer_or_skip():
    if not GPU:
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flashinfer")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 too, but each dtype is one more JIT build
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [
        (ForwardMode.EXTEND, [1000, 70, 2500, 9], [0, 64, 2000, 8]),  # plain prefill, cached prefixes, 1 new token
        # a mixed step: decode rows first (Triton decode kernels), then prompts and a one-token chunk (prefill)
        (ForwardMode.EXTEND, [2049, 1, 777, 1000, 70, 5], [2048, 0, 776, 0, 64, 4]),
        (ForwardMode.EXTEND, [300, 1, 4097], [299, 0, 4096]),  # one-token requests only
        (ForwardMode.DECODE, [4096, 1, 777, 2049], [4095, 0, 776, 2048]),
    ],
    ids=["extend", "mixed", "extend-one-token", "decode"],
)
def test_gpu_flashinfer_matches_torch_native(dtype, heads, kv_heads, head_dim, mode, seq_lens, prefix_lens):
    _flashinfer_or_skip()
    from test_triton_kernels import ATOL, run_backend

    out, k_buf, v_buf = run_backend("flashinfer", mode, seq_lens, prefix_lens, heads, kv_heads, head_dim, dtype)
    ref, k_ref, v_ref = run_backend("torch_native", mode, seq_lens, prefix_lens, heads, kv_heads, head_dim, dtype)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * ATOL[dtype], rtol=0)


def test_flashinfer_prefill_kinds_are_the_configs():
    """EngineConfig.flashinfer_prefill's choices are the backend's (config does not import the kernels)."""
    from engine.config import FLASHINFER_PREFILL, EngineConfig
    from engine.errors import InvalidConfigError
    from kernels.attention.flashinfer import PREFILL_KINDS

    assert FLASHINFER_PREFILL == PREFILL_KINDS
    assert EngineConfig().flashinfer_prefill == "auto"
    with pytest.raises(InvalidConfigError, match="flashinfer_prefill"):
        EngineConfig(flashinfer_prefill="ragged-fa9")


def test_flashinfer_prefill_auto_resolves_by_architecture():
    """ "auto" is the ragged FA3 kernel on Hopper (compute capability 9.x), the paged FA2 kernel elsewhere; an
    explicit FA3 kind off Hopper is a ValueError naming the device's capability, not a failure inside FlashInfer."""
    from kernels.attention.flashinfer import PREFILL_KINDS, resolve_prefill_kind

    assert resolve_prefill_kind("auto", (9, 0)) == "ragged-fa3"
    for capability in [(8, 0), (8, 9), (10, 0), (12, 0)]:
        assert resolve_prefill_kind("auto", capability) == "paged-fa2"
        assert resolve_prefill_kind("ragged-fa2", capability) == "ragged-fa2"
        for kind in ("paged-fa3", "ragged-fa3"):
            with pytest.raises(ValueError, match=f"{capability[0]}.{capability[1]}"):
                resolve_prefill_kind(kind, capability)
    for kind in PREFILL_KINDS[1:]:
        assert resolve_prefill_kind(kind, (9, 0)) == kind
    with pytest.raises(ValueError, match="prefill must be one of"):
        resolve_prefill_kind("ragged-fa9", (9, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("prefill", ["paged-fa2", "paged-fa3", "ragged-fa2", "ragged-fa3", "auto"])
@pytest.mark.parametrize("triton_decode_rows", [True, False], ids=["decode-rows-triton", "decode-rows-prefill"])
@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [
        (ForwardMode.EXTEND, [1000, 70, 2500, 9], [0, 0, 0, 0]),  # whole prompts: the ragged kernel
        (ForwardMode.EXTEND, [1000, 70, 2500, 9], [0, 64, 2000, 8]),  # cached prefixes beside none: paged
        (ForwardMode.EXTEND, [2049, 1, 777, 1000, 70, 5], [2048, 0, 776, 0, 64, 4]),  # a mixed step
        (ForwardMode.EXTEND, [1025, 513, 1000, 70], [1024, 512, 0, 0]),  # decodes, then whole prompts
    ],
    ids=["no-prefix", "prefixes", "mixed", "decodes-whole-prompts"],
)
def test_gpu_flashinfer_prefill_kinds_match_torch_native(prefill, triton_decode_rows, mode, seq_lens, prefix_lens):
    """Every prompt-row kernel (EngineConfig.flashinfer_prefill) against the float32-accumulating reference, with
    a mixed step's decode rows on the Triton decode kernels or on the prompt rows' kernel."""
    _flashinfer_or_skip()
    if prefill.endswith("fa3") and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's FA3 kernels run on Hopper only")
    from test_triton_kernels import ATOL, run_backend

    args = (mode, seq_lens, prefix_lens, 32, 8, 128, torch.bfloat16)
    out, k_buf, v_buf = run_backend("flashinfer", *args, prefill=prefill, triton_decode_rows=triton_decode_rows)
    ref, k_ref, v_ref = run_backend("torch_native", *args)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * ATOL[torch.bfloat16], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer", "triton"])
@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [
        (ForwardMode.EXTEND, [1000, 70, 9], [0, 64, 8]),
        (ForwardMode.EXTEND, [2049, 777, 1000], [2048, 776, 0]),
        (ForwardMode.DECODE, [2049, 1, 777], [2048, 0, 776]),
    ],
    ids=["extend", "mixed", "decode"],
)
def test_gpu_backends_address_a_large_token_major_pool(name, mode, seq_lens, prefix_lens):
    """Llama-3.1-8B's pool shape (32 layers, 8 KV heads × 128, bf16: 65,536 elements per slot) with the data
    beyond slot 40,000 of the last layer: element offsets pass 2**31, so 32-bit offset arithmetic would fail."""
    if name == "flashinfer":
        _flashinfer_or_skip()
    elif not GPU:
        pytest.skip("needs a CUDA device")
    from test_triton_kernels import ATOL, run_backend

    args = (mode, seq_lens, prefix_lens, 32, 8, 128, torch.bfloat16)
    out, k_buf, v_buf = run_backend(name, *args, num_layers=32, slot_offset=40_000)
    assert k_buf.stride(0) * 40_000 > 2**31
    ref, k_ref, v_ref = run_backend("torch_native", *args)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * ATOL[torch.bfloat16], rtol=0)
    del out, k_buf, v_buf
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_flashinfer_rejects_float32():
    _flashinfer_or_skip()
    from engine.memory.kv_pool import KVPool
    from kernels.attention.base import get_backend_class

    pool = KVPool(16, 1, 2, 64, torch.float32, DEVICE)
    r2t = torch.zeros(2, 16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        get_backend_class("flashinfer")(r2t, pool, 4, 2, 64, 0.125)


# ------------------------------------------------------------------------------------ sampling


def test_fused_gumbel_argmax_matches_torch_path():
    """The fused kernel draws the same tokens as logits + gumbel_noise(...) -> argmax, for many seeds."""
    from engine.runner.sampler import _row_keys, gumbel_noise
    from kernels.triton.sampling import gumbel_argmax

    bs, vocab = (64, 128256) if GPU else (8, 3000)
    logits = randn(bs, vocab, dtype=torch.float32) * 3
    logits[5, 1000:] = float("-inf")  # a filtered row
    seeds = torch.randint(0, 2**62, (bs,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for step in range(4):
        steps = torch.full((bs,), step, dtype=torch.int64, device=DEVICE)
        ref = (logits + gumbel_noise(seeds, steps, vocab)).argmax(dim=-1)
        ours = gumbel_argmax(logits, _row_keys(seeds, steps).squeeze(1))
        assert torch.equal(ours, ref)
        assert int(ours[5]) < 1000
