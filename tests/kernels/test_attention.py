"""TorchNativeAttnBackend against dense causal attention over each request's full K/V."""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_pool import KVPool
from kernels.attention.base import get_backend_class

H, HKV, D, PAGE = 4, 2, 16, 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """q (n, H, D) at positions [prefix, prefix + n); k, v (prefix + n, Hkv, D) -> (n, H, D), float64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n, L = q.shape[0], k.shape[0]
    causal = torch.arange(L)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_setup(seq_lens, seed=0, dtype=torch.float32):
    """A pool with scattered pages: request i's positions map to randomly ordered pages of PAGE slots."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(seq_lens)
    pages_per_req = -(-max_len // PAGE)
    num_pages = 1 + len(seq_lens) * pages_per_req + 3
    pool = KVPool(num_pages * PAGE, 1, HKV, D, dtype, torch.device("cpu"))
    page_order = 1 + torch.randperm(num_pages - 1, generator=gen)  # page 0 never used
    req_to_token = torch.zeros(len(seq_lens) + 2, max_len + 5, dtype=torch.int32)
    req_rows = [2, 0, 3, 1][: len(seq_lens)] if len(seq_lens) <= 4 else list(range(len(seq_lens)))
    for i, row in enumerate(req_rows):
        pages = page_order[i * pages_per_req : (i + 1) * pages_per_req]
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)[None, :]).flatten()[:max_len]
        req_to_token[row, :max_len] = slots.int()
    backend = get_backend_class("torch_native")(req_to_token, pool, H, HKV, D, D**-0.5)
    full_k = [torch.randn(n, HKV, D, generator=gen).to(dtype) for n in seq_lens]
    full_v = [torch.randn(n, HKV, D, generator=gen).to(dtype) for n in seq_lens]
    full_q = [torch.randn(n, H, D, generator=gen).to(dtype) for n in seq_lens]
    return pool, req_to_token, req_rows, backend, full_q, full_k, full_v


def run_case(mode, seq_lens, prefix_lens, dtype=torch.float32, atol=1e-5):
    pool, r2t, rows, backend, fq, fk, fv = make_setup(seq_lens, dtype=dtype)
    # the cached prefixes are already in the pool
    for i, (row, p) in enumerate(zip(rows, prefix_lens)):
        slots = r2t[row, :p].long()
        pool.k_buffers[0][slots], pool.v_buffers[0][slots] = fk[i][:p], fv[i][:p]
    q = torch.cat([fq[i][p:] for i, p in enumerate(prefix_lens)])
    k = torch.cat([fk[i][p:] for i, p in enumerate(prefix_lens)])
    v = torch.cat([fv[i][p:] for i, p in enumerate(prefix_lens)])
    locs = torch.cat([r2t[row, p:n].long() for row, p, n in zip(rows, prefix_lens, seq_lens)])
    positions = [j for p, n in zip(prefix_lens, seq_lens) for j in range(p, n)]
    batch = ForwardBatch.build(
        mode, [0] * len(positions), positions, locs, rows, list(seq_lens), list(prefix_lens), torch.device("cpu")
    )
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)
    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, seq_lens)):
        ref = dense_attention(fq[i][p:], fk[i], fv[i], p, D**-0.5)
        torch.testing.assert_close(out[start : start + n - p].double(), ref, atol=atol, rtol=0)
        start += n - p
    # the new K/V landed in the pool at their slots
    torch.testing.assert_close(pool.k_buffers[0][locs], k)
    torch.testing.assert_close(pool.v_buffers[0][locs], v)


@pytest.mark.parametrize(
    "seq_lens,prefix_lens",
    [
        ([5, 17, 1], [0, 0, 0]),  # plain prefill
        ([9, 23, 12, 30], [4, 0, 11, 7]),  # cached prefixes, one request with a single new token
        ([33], [32]),
    ],
)
def test_extend_matches_dense(seq_lens, prefix_lens):
    run_case(ForwardMode.EXTEND, seq_lens, prefix_lens)


@pytest.mark.parametrize("seq_lens", [[1], [7, 1, 20, 13], [3, 40, 2, 8, 16]])
def test_decode_matches_dense(seq_lens):
    run_case(ForwardMode.DECODE, seq_lens, [n - 1 for n in seq_lens])


def test_decode_ignores_garbage_beyond_seq_len():
    """req_to_token entries past seq_len may hold anything (here: out-of-range ids)."""
    pool, r2t, rows, backend, fq, fk, fv = make_setup([6, 3])
    r2t[rows[1], 3:] = 10**6
    for i, (row, n) in enumerate(zip(rows, [6, 3])):
        slots = r2t[row, :n].long()
        pool.k_buffers[0][slots], pool.v_buffers[0][slots] = fk[i], fv[i]
    batch = ForwardBatch.build(
        ForwardMode.DECODE,
        [0, 0],
        [5, 2],
        torch.stack([r2t[rows[0], 5], r2t[rows[1], 2]]),
        rows,
        [6, 3],
        [5, 2],
        torch.device("cpu"),
    )
    out = backend.forward(
        torch.stack([fq[0][5], fq[1][2]]),
        torch.stack([fk[0][5], fk[1][2]]),
        torch.stack([fv[0][5], fv[1][2]]),
        0,
        batch,
    )
    torch.testing.assert_close(
        out[1].double(), dense_attention(fq[1][2:], fk[1], fv[1], 2, D**-0.5)[0], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_half_precision(dtype, mode):
    seq_lens = [8, 19, 4]
    prefix = [3, 0, 2] if mode == ForwardMode.EXTEND else [n - 1 for n in seq_lens]
    run_case(mode, seq_lens, prefix, dtype=dtype, atol=2e-2)


def test_metadata_rebuilt_without_init_call():
    """forward() builds its own metadata when the caller skipped init_forward_metadata."""
    pool, r2t, rows, backend, fq, fk, fv = make_setup([4, 4])
    for mode, n in [(ForwardMode.EXTEND, 4), (ForwardMode.DECODE, 1)]:
        p = 4 - n
        locs = torch.cat([r2t[r, p:4].long() for r in rows])
        batch = ForwardBatch.build(
            mode, [0] * 2 * n, list(range(p, 4)) * 2, locs, rows, [4, 4], [p, p], torch.device("cpu")
        )
        q = torch.cat([x[p:] for x in fq])
        out = backend.forward(q, torch.cat([x[p:] for x in fk]), torch.cat([x[p:] for x in fv]), 0, batch)
        ref = torch.cat([dense_attention(fq[i][p:], fk[i], fv[i], p, D**-0.5) for i in range(2)])
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
