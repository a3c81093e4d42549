"""radixserve's Triton kernels (kernels/triton/) against their plain-torch references, and TritonAttnBackend
against TorchNativeAttnBackend.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before any kernel
module is imported) on small shapes; the same tests run compiled on a GPU, and the @pytest.mark.gpu tests add
realistic shapes (long contexts, Llama-3-8B heads) there. Skipped when triton is not installed.

Tolerances, against references computed in float32 from the same (rounded) inputs:
  fp32  1e-5  — logits, softmax and P @ V all in float32 (tl.dot with input_precision="ieee", not TF32).
  fp16  4e-3  — P is rounded to fp16 before P @ V (10-bit mantissa, ~5e-4 relative per term) and the output
                is rounded to fp16 (|out| < ~3 since it is a convex mix of N(0, 1) values: <= 2e-3).
  bf16  3e-2  — same with bf16's 7-bit mantissa: P rounding ~4e-3 relative, output rounding <= 1.6e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from engine.memory.kv_pool import KVPool  # noqa: E402
from kernels.attention.base import get_backend_class  # noqa: E402
from kernels.triton import fix_interpreter_scalar_index  # noqa: E402
from kernels.triton.decode_attention import (
    alloc_decode_scratch,
    decode_attention,
    decode_attention_reference,  # noqa: E402
    pick_num_kv_splits,
)
from kernels.triton.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from kernels.triton.store_kv import store_kv, store_kv_reference  # noqa: E402

fix_interpreter_scalar_index()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class Paged:
    """A KV pool whose pages are scattered at random: request i's positions live in shuffled pages of PAGE
    slots, in req_to_token row rows[i] (rows are shuffled too); page 0 is never used. Entries past a
    request's length point at other requests' valid slots, so reading past seq_len gives wrong answers."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, dtype, page=4, seed=0):
        gen = torch.Generator().manual_seed(seed)
        bs, max_len = len(seq_lens), max(seq_lens)
        pages_per_req = -(-max_len // page)
        num_pages = 1 + bs * pages_per_req
        order = 1 + torch.randperm(num_pages - 1, generator=gen)
        self.rows = torch.randperm(bs + 2, generator=gen)[:bs]
        self.req_to_token = (1 + torch.randint(0, num_pages * page - 1, (bs + 2, max_len + 7), generator=gen)).int()
        for i, row in enumerate(self.rows.tolist()):
            pages = order[i * pages_per_req : (i + 1) * pages_per_req]
            self.req_to_token[row, :max_len] = (pages[:, None] * page + torch.arange(page)).flatten()[:max_len].int()
        shape = (num_pages * page, num_kv_heads, head_dim)
        self.k_buf = torch.randn(shape, generator=gen).to(dtype)
        self.v_buf = torch.randn(shape, generator=gen).to(dtype)
        self.gen = gen
        self.seq_lens = torch.tensor(seq_lens)
        for name in ("rows", "req_to_token", "k_buf", "v_buf", "seq_lens"):
            setattr(self, name, getattr(self, name).to(DEVICE))

    def randn(self, *shape, dtype):
        return torch.randn(*shape, generator=self.gen).to(dtype=dtype, device=DEVICE)


# ---------------------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,d", [(2, 64), (1, 128), (3, 16)])
def test_store_kv_matches_reference(buf_dtype, hkv, d):
    p = Paged([9, 5], hkv, d, buf_dtype)
    loc = torch.cat([p.req_to_token[p.rows[0], 3:9], p.req_to_token[p.rows[1], 0:5]]).long()
    # k, v as views of a fused qkv projection: last dim contiguous, rows strided; float32 in, cast on store
    kv = p.randn(11, 2 * hkv + 1, d, dtype=torch.float32)
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    k_ref, v_ref = p.k_buf.clone(), p.v_buf.clone()
    store_kv(p.k_buf, p.v_buf, loc, k, v)
    store_kv_reference(k_ref, v_ref, loc, k, v)
    if DEVICE.type == "cpu" and buf_dtype == torch.bfloat16:
        # the interpreter's float32 -> bf16 cast truncates where torch rounds to nearest: 1 bf16 ulp apart
        torch.testing.assert_close(p.k_buf, k_ref, rtol=2**-7, atol=0)
        torch.testing.assert_close(p.v_buf, v_ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(p.k_buf, k_ref) and torch.equal(p.v_buf, v_ref)


# ---------------------------------------------------------------------------------------------- decode


def check_decode(seq_lens, num_heads, num_kv_heads, head_dim, dtype, num_splits=None):
    p = Paged(seq_lens, num_kv_heads, head_dim, dtype)
    bs = len(seq_lens)
    q = p.randn(bs, num_heads, head_dim, dtype=dtype)
    splits = num_splits or pick_num_kv_splits(bs, num_kv_heads, max(seq_lens), DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, p.k_buf, p.v_buf, out, p.req_to_token, p.rows, p.seq_lens, head_dim**-0.5, splits)
    ref = decode_attention_reference(q, p.k_buf, p.v_buf, p.req_to_token, p.rows, p.seq_lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_matches_reference(group, head_dim, num_splits):
    # 1: a single position; 37, 100: not multiples of any chunk; with 8 splits some chunks of short rows are empty
    check_decode([37, 1, 100, 64], 2 * group, 2, head_dim, torch.float32, num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype):
    check_decode([70, 3, 33], 8, 2, 64, dtype, num_splits=3)


def test_decode_seq_len_one_batch_of_one():
    check_decode([1], 4, 4, 64, torch.float32, num_splits=4)


def test_decode_skips_empty_splits_bit_for_bit():
    """A CUDA graph fixes num_splits for every context length: the chunks a short context leaves empty are
    neither written by stage 1 nor merged by stage 2, and the output is bit-identical to a launch whose
    splits cut the context the same way. float32 KV walks 32-position blocks, so with 64 splits the
    contexts 20, 60 and 120 use 1, 2 and 4 chunks of 32 positions (as they do with 4 splits)."""
    lens, used = [20, 60, 120], [1, 2, 4]
    p = Paged(lens, 2, 64, torch.float32)
    q = p.randn(3, 4, 64, dtype=torch.float32)
    args = (p.req_to_token, p.rows, p.seq_lens, 64**-0.5)
    mid_o, mid_lse = alloc_decode_scratch(3, 4, 64, 64, DEVICE)
    mid_o.fill_(7.0)
    mid_lse.fill_(7.0)
    wide = decode_attention(q, p.k_buf, p.v_buf, torch.empty_like(q), *args, 64, mid_o, mid_lse)
    for row, n in enumerate(used):
        assert torch.all(mid_lse[row, :, n:] == 7.0) and torch.all(mid_o[row, :, n:] == 7.0)
        assert torch.all(mid_lse[row, :, :n] != 7.0)
    for splits in (1, 2, 4):
        narrow = decode_attention(q, p.k_buf, p.v_buf, torch.empty_like(q), *args, splits)
        same = [row for row, n in enumerate(used) if n <= splits]  # cut into the same chunks
        assert torch.equal(wide[same], narrow[same]), splits
    ref = decode_attention_reference(q, p.k_buf, p.v_buf, *args)
    torch.testing.assert_close(wide, ref, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_one_split_writes_the_merged_output_bit_for_bit(dtype):
    """One split: stage 1 writes the output itself and leaves the split scratch alone (no stage 2). It is
    bit-identical to stage 2's merge of one split: contexts of at most one block (32 positions in float32,
    64 in bf16) leave a two-split launch a single non-empty split, which stage 2 merges."""
    lens = [1, 17, 32]
    p = Paged(lens, 2, 64, dtype)
    q = p.randn(3, 8, 64, dtype=dtype)
    args = (p.req_to_token, p.rows, p.seq_lens, 64**-0.5)
    mid_o, mid_lse = alloc_decode_scratch(3, 8, 64, 1, DEVICE)
    mid_o.fill_(7.0)
    mid_lse.fill_(7.0)
    one = decode_attention(q, p.k_buf, p.v_buf, torch.full_like(q, float("nan")), *args, 1, mid_o, mid_lse)
    assert torch.all(mid_o == 7.0) and torch.all(mid_lse == 7.0)
    merged = decode_attention(q, p.k_buf, p.v_buf, torch.full_like(q, float("nan")), *args, 2)
    assert torch.equal(one, merged)
    ref = decode_attention_reference(q, p.k_buf, p.v_buf, *args)
    torch.testing.assert_close(one.float(), ref.float(), atol=ATOL[dtype], rtol=0)


def test_num_kv_splits_heuristic():
    assert pick_num_kv_splits(1, 8, 1, DEVICE) == 1  # nothing to split
    assert pick_num_kv_splits(1, 8, 4096, DEVICE) > 1  # batch 1, long context: split
    assert pick_num_kv_splits(4096, 8, 4096, DEVICE) == 1  # big batch fills the GPU alone
    assert pick_num_kv_splits(1, 1, 10**6, DEVICE) <= 64


# ---------------------------------------------------------------------------------------------- extend


def check_extend(prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype):
    seq_lens = [a + b for a, b in zip(prefix_lens, extend_lens)]
    p = Paged(seq_lens, num_kv_heads, head_dim, dtype)
    T = sum(extend_lens)
    q = p.randn(T, num_heads, head_dim, dtype=dtype)
    k, v = p.randn(T, num_kv_heads, head_dim, dtype=dtype), p.randn(T, num_kv_heads, head_dim, dtype=dtype)
    starts = torch.tensor([0] + extend_lens[:-1]).cumsum(0).to(DEVICE)
    args = (
        p.req_to_token,
        p.rows,
        torch.tensor(prefix_lens, device=DEVICE),
        torch.tensor(extend_lens, device=DEVICE),
        starts,
    )
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k, v, out, p.k_buf, p.v_buf, *args, max(extend_lens), head_dim**-0.5)
    ref = extend_attention_reference(q, k, v, p.k_buf, p.v_buf, *args, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0, 0, 0], [5, 33, 1]),  # plain prefill; lengths around the 16-row interpreter blocks
        ([20, 0, 7, 40], [13, 17, 1, 2]),  # cached prefixes, one request with no prefix, single new tokens
    ],
)
def test_extend_matches_reference(group, head_dim, prefix_lens, extend_lens):
    check_extend(prefix_lens, extend_lens, 2 * group, 2, head_dim, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_half_precision(dtype):
    check_extend([9, 0], [20, 6], 8, 2, 64, dtype)


# ---------------------------------------------------------------------------------------------- backend


def run_backend(
    name,
    mode,
    seq_lens,
    prefix_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    seed=0,
    num_layers=1,
    slot_offset=0,
    out=False,
    **backend_kwargs,
):
    """One forward of backend `name` (built with `backend_kwargs`) on a fresh scattered pool; -> (out, k_buf,
    v_buf). `out`: the forward writes into a tensor given to it (NaN-filled before), which it must return.

    The pool is the engine's token-major KVPool with `num_layers` layers; the forward runs on the last layer,
    and every slot is moved up by `slot_offset` (to reach element offsets beyond 2**31 in a large pool)."""
    p = Paged(seq_lens, num_kv_heads, head_dim, dtype, seed=seed)
    pool = KVPool(p.k_buf.shape[0] + slot_offset, num_layers, num_kv_heads, head_dim, dtype, DEVICE)
    layer = num_layers - 1
    k_pool, v_pool = (buf[slot_offset:] for buf in pool.get_kv_buffer(layer))
    k_pool.copy_(p.k_buf)
    v_pool.copy_(p.v_buf)
    p.req_to_token += slot_offset
    T = sum(s - x for s, x in zip(seq_lens, prefix_lens))
    qkv = p.randn(T, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)  # strided views, like the model's
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    rows = p.rows.tolist()
    locs = torch.cat([p.req_to_token[r, x:s] for r, x, s in zip(rows, prefix_lens, seq_lens)])
    positions = [j for x, s in zip(prefix_lens, seq_lens) for j in range(x, s)]
    batch = ForwardBatch.build(mode, [0] * T, positions, locs, rows, list(seq_lens), list(prefix_lens), DEVICE)
    backend = get_backend_class(name)(
        p.req_to_token, pool, num_heads, num_kv_heads, head_dim, head_dim**-0.5, **backend_kwargs
    )
    backend.init_forward_metadata(batch)
    if not out:
        return backend.forward(q, k, v, layer, batch), k_pool, v_pool
    given = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    result = backend.forward(q, k, v, layer, batch, out=given)
    assert result is given
    return given, k_pool, v_pool


@pytest.mark.parametrize("name", ["triton", "torch_native"])
@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [(ForwardMode.EXTEND, [9, 23, 12], [4, 0, 11]), (ForwardMode.DECODE, [7, 1, 45], [6, 0, 44])],
    ids=["extend", "decode"],
)
def test_backend_writes_its_output_where_given(name, mode, seq_lens, prefix_lens):
    """forward(..., out=t) writes the result into t and returns t: the same bits as the result it allocates
    (the piecewise runner hands the attention its static output buffer this way)."""
    args = (name, mode, seq_lens, prefix_lens, 4, 2, 16, torch.float32)
    want, _, _ = run_backend(*args)
    got, _, _ = run_backend(*args, out=True)
    assert torch.equal(got, want)


def check_backend(mode, seq_lens, prefix_lens, num_heads, num_kv_heads, head_dim, dtype):
    out, k_buf, v_buf = run_backend("triton", mode, seq_lens, prefix_lens, num_heads, num_kv_heads, head_dim, dtype)
    ref, k_ref, v_ref = run_backend(
        "torch_native", mode, seq_lens, prefix_lens, num_heads, num_kv_heads, head_dim, dtype
    )
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * ATOL[dtype], rtol=0)


@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [
        (ForwardMode.EXTEND, [9, 23, 12, 30], [4, 0, 11, 7]),
        (ForwardMode.DECODE, [7, 1, 45, 13], [6, 0, 44, 12]),
    ],
)
def test_backend_matches_torch_native(mode, seq_lens, prefix_lens):
    check_backend(mode, seq_lens, prefix_lens, 8, 2, 64, torch.float32)


@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [
        (ForwardMode.EXTEND, [9, 23], [4, 0]),
        (ForwardMode.DECODE, [7, 13], [6, 12]),
    ],
)
def test_backend_on_a_later_layer_of_a_multi_layer_pool(mode, seq_lens, prefix_lens):
    """The per-layer K/V views of a token-major pool are strided (slot stride = layers × 2 × Hkv × D)."""
    args = (mode, seq_lens, prefix_lens, 4, 2, 16, torch.float32)
    out, k_buf, v_buf = run_backend("triton", *args, num_layers=3, slot_offset=5)
    ref, k_ref, v_ref = run_backend("torch_native", *args, num_layers=3, slot_offset=5)
    assert k_buf.stride(0) == 3 * 2 * 2 * 16
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out, ref, atol=2 * ATOL[torch.float32], rtol=0)


def test_backend_is_registered():
    from kernels.attention.base import available_backends
    from kernels.attention.triton import TritonAttnBackend

    assert "triton" in available_backends() and get_backend_class("triton") is TritonAttnBackend


def tiny_llama(device):
    """A 2-layer random Llama (GQA 4:2, head_dim 16) with the engine's model class, float32."""
    from transformers import LlamaConfig

    from engine.models.loader import load_model  # imported here: the loader is not needed by the kernel tests
    from engine.models.source import ModelSource

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    return load_model(ModelSource(name="tiny-llama", folder="unused"), config, "dummy", torch.float32, device)


def check_greedy(prompt_lens, max_new_tokens, prefill_chunk):
    from model_harness import GreedyHarness

    model = tiny_llama(DEVICE)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in prompt_lens]
    results = {
        name: GreedyHarness(model, max_len=128, max_reqs=4, backend=name).generate(
            prompts, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk
        )
        for name in ("triton", "torch_native")
    }
    ours, ref = results["triton"], results["torch_native"]
    assert ours.output_ids == ref.output_ids
    for a, b in zip(ours.prefill_logits + ours.decode_logits, ref.prefill_logits + ref.decode_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_greedy_matches_torch_native():
    """Chunked prefill (prefix > 0 on the second chunk) then batched decode: same tokens as the reference."""
    check_greedy([5, 17, 11], max_new_tokens=6, prefill_chunk=8)


# ---------------------------------------------------------------------------------------------- GPU shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 128), (4, 64)])
def test_gpu_decode_long_contexts(dtype, group, head_dim):
    # batch 1 on 4k+1 positions exercises split-K with a ragged last chunk; the batch mixes lengths
    check_decode([4097], 8 * group, 8, head_dim, dtype)
    check_decode([1, 4097, 300, 2048, 17, 1000], 8 * group, 8, head_dim, dtype)
    check_decode([3000, 5], 8 * group, 8, head_dim, dtype, num_splits=7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 128), (4, 64)])
def test_gpu_extend_long_prefixes(dtype, group, head_dim):
    check_extend([0, 1500, 37, 0, 900], [700, 300, 1, 129, 65], 8 * group, 8, head_dim, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode,seq_lens,prefix_lens",
    [
        (ForwardMode.EXTEND, [1000, 70, 2500], [0, 64, 2000]),
        (ForwardMode.DECODE, [4096, 1, 777, 2049], [4095, 0, 776, 2048]),
    ],
)
def test_gpu_backend_llama3_8b_heads(mode, seq_lens, prefix_lens):
    check_backend(mode, seq_lens, prefix_lens, 32, 8, 128, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_greedy_matches_torch_native():
    check_greedy([30, 100, 64, 7], max_new_tokens=12, prefill_chunk=48)


def _check_triton_specialization(code: str) -> None:
    """Run `code` with Triton's own specialization (a subprocess without the interpreter, which has none);
    it prints "one variant" when every kernel it checks keeps one key."""
    import subprocess
    import sys

    prelude = """
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

def key(fn, values):
    k = [native_specialize_impl(BaseBackend, values[p.name], False, not p.do_not_specialize,
                                not p.do_not_specialize_on_alignment) for p in fn.params if p.name in values]
    assert len(k) == len(values), (fn, sorted(values), [p.name for p in fn.params])
    return repr(k)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", prelude + code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "one variant" in done.stdout, done.stderr


def test_decode_kernels_compile_one_variant_for_every_split_count():
    """Triton compiles a kernel once per specialization of its arguments, and turns an integer argument
    equal to 1 into a constant. The split count (and the scratch stride equal to it) falls to 1 only in
    large batches, so a specialized kernel would compile mid-serving, after the warm-up: the decode kernels
    must not specialize on them."""
    _check_triton_specialization("""
from kernels.triton import decode_attention as d

for fn in (d._decode_stage1, d._decode_stage2):
    keys = {key(fn, {"num_splits": s, "stride_ml_h": s}) for s in (1, 5, 16)}
    assert len(keys) == 1, (fn, keys)
print("one variant")
""")


def test_kernels_on_batch_views_compile_one_variant_for_any_alignment():
    """Triton also specializes a pointer on whether its address is a multiple of 16 bytes. The per-request
    arrays of a step are views into its packed int64 tensor (engine/forward_batch.py), sliced further for a
    mixed step's decode rows: their alignment follows the batch size and the number of decode rows, so a
    batch of a new parity would compile a variant mid-serving (seen on a GPU: _kv_indices_kernel at the
    first request after the warm-up). Every kernel taking such a view keeps one variant."""
    _check_triton_specialization("""
import torch
from kernels.triton import decode_attention, extend_attention, fused_layers, store_kv

packed = torch.arange(64)
views = (packed[2:10], packed[3:11])  # 16-byte aligned, then 8 bytes off
kernels = {
    decode_attention._decode_stage1: ["Req_pool_indices", "Seq_lens"],
    decode_attention._decode_stage2: ["Seq_lens"],
    extend_attention._extend_kernel: ["Req_pool_indices", "Prefix_lens", "Extend_lens", "Extend_start"],
    fused_layers._kv_indices_kernel: ["Req_pool_indices", "Seq_lens"],
    store_kv._store_kv_kernel: ["Loc"],
}
for fn, names in kernels.items():
    keys = {key(fn, dict.fromkeys(names, view)) for view in views}
    assert len(keys) == 1, (fn, keys)
print("one variant")
""")
