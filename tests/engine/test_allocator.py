"""TokenToKVPoolAllocator and ReqToTokenPool: page accounting, continuation inside pages, double frees."""

import pytest
import torch

from engine.memory.allocator import TokenToKVPoolAllocator
from engine.memory.req_to_token import ReqToTokenPool


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_extend_continues_partial_page(page_size):
    a = TokenToKVPoolAllocator(num_pages=9, page_size=page_size)
    assert a.size == 8 * page_size and a.available_size() == a.size
    first = a.alloc_extend([0], [5], [-1])
    assert len(set(first.tolist())) == 5
    if page_size == 16:  # one page, contiguous
        assert first.tolist() == list(range(page_size, page_size + 5))
    assert (first >= page_size).all(), "page 0 is reserved"
    more = a.alloc_extend([5], [7], [int(first[-1])])
    if page_size == 16:  # continues in the same page
        assert more.tolist() == [page_size + 5, page_size + 6]
    slots = torch.cat([first, more])
    assert len(set(slots.tolist())) == 7
    a.free(slots)
    assert a.available_size() == a.size


def test_alloc_decode_takes_new_page_only_at_page_start():
    a = TokenToKVPoolAllocator(num_pages=5, page_size=4)
    base = a.alloc_extend([0, 0], [4, 3], [-1, -1])
    last = torch.tensor([int(base[3]), int(base[6])])
    out = a.alloc_decode(torch.tensor([5, 4]), last)
    # request 0: position 4 starts a page → new page; request 1: position 3 continues.
    assert int(out[0]) % 4 == 0 and int(out[0]) // 4 not in (int(base[0]) // 4, int(base[4]) // 4)
    assert int(out[1]) == int(base[6]) + 1


def test_out_of_pages_returns_none_and_takes_nothing():
    a = TokenToKVPoolAllocator(num_pages=3, page_size=2)
    assert a.alloc_extend([0], [5], [-1]) is None
    assert a.available_size() == 4


def test_double_free_raises():
    a = TokenToKVPoolAllocator(num_pages=4, page_size=1)
    s = a.alloc_extend([0], [2], [-1])
    a.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s)


def test_req_to_token_rows():
    pool = ReqToTokenPool(size=2, max_context_len=8, device=torch.device("cpu"))
    r = pool.alloc()
    pool.write(r, 0, torch.tensor([5, 6, 7]))
    pool.write(r, 3, torch.tensor([9]))
    assert pool.read(r, 4).tolist() == [5, 6, 7, 9]
    pool.alloc()
    assert pool.available_size() == 0
    pool.free(r)
    assert pool.available_size() == 1


def test_pages_come_back_sorted_so_allocations_stay_consecutive():
    a = TokenToKVPoolAllocator(num_pages=9, page_size=2)
    first = a.alloc_pages(6)
    assert first.tolist() == [1, 2, 3, 4, 5, 6]
    a.free(torch.tensor([10, 4, 6, 2]))  # slots of pages 5, 2, 3, 1 (freed out of order)
    assert a.available_size() == 6 * 2
    assert a.alloc_pages(2).tolist() == [7, 8]  # the never-used pages first
    assert a.alloc_pages(3).tolist() == [1, 2, 3]  # then the freed ones, merged in ascending order
    assert a.alloc_pages(2) is None and a.available_size() == 2
    assert a.alloc_pages(1).tolist() == [5]


def test_kv_pool_is_token_major_with_per_layer_views():
    from engine.memory.kv_pool import KVPool

    pool = KVPool(
        num_slots=6, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu")
    )
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.set_kv_buffer(1, torch.tensor([4, 2]), k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.shape == (6, 2, 4) and k_buf.stride() == (3 * 2 * 2 * 4, 4, 1)
    assert torch.equal(k_buf[4], k[0]) and torch.equal(v_buf[2], v[1])
    assert torch.equal(pool.kv_data[4, 1, 0], k[0]) and torch.equal(pool.kv_data[2, 1, 1], v[1])
    rows = pool.slot_rows()
    assert rows.shape == (6, 3 * 2 * 2 * 4) and rows.is_contiguous()
    assert rows.data_ptr() == pool.kv_data.data_ptr()
    # Slot s's row holds layer l's K at [l*16, l*16+8) and V right after it.
    assert torch.equal(rows[4, 16:24].view(2, 4), k[0]) and torch.equal(rows[2, 24:32].view(2, 4), v[1])
    assert not rows[[0, 1, 3, 5]].any()


@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_manager_alloc_extend_records_every_request_row_in_one_write(page_size):
    """A mixed batch: requests with cached prefixes (a decode row is one token past its prefix) and a new
    prompt; each row of the table gets its own slots, at its own columns, and nothing else moves."""
    from types import SimpleNamespace

    from engine.memory.kv_cache_manager import KVCacheManager
    from engine.memory.radix_cache import RadixCache

    alloc = TokenToKVPoolAllocator(256, page_size=page_size)
    pool = ReqToTokenPool(8, 64, torch.device("cpu"))
    kv = KVCacheManager(pool, alloc, RadixCache(alloc, page_size=page_size), page_size, False)
    reqs = []
    for row, (kv_len, extend_len) in enumerate([(0, 9), (0, 3), (0, 6)]):
        req = SimpleNamespace(req_pool_idx=pool.alloc(), kv_len=kv_len, extend_len=extend_len)
        req.slots = kv.alloc_extend([req])
        req.kv_len, reqs = extend_len, reqs + [req]
    before = pool.host.clone()
    reqs[0].extend_len, reqs[1].extend_len, reqs[2].extend_len = 1, 1, 5  # two decode rows, one chunk
    fresh = SimpleNamespace(req_pool_idx=pool.alloc(), kv_len=0, extend_len=7)
    batch = reqs + [fresh]
    out = kv.alloc_extend(batch)
    assert out.numel() == 1 + 1 + 5 + 7 and len(set(out.tolist())) == out.numel()
    start, changed = 0, torch.zeros_like(pool.host, dtype=torch.bool)
    for r in batch:
        cols = slice(r.kv_len, r.kv_len + r.extend_len)
        assert pool.host[r.req_pool_idx, cols].tolist() == out[start : start + r.extend_len].tolist()
        changed[r.req_pool_idx, cols] = True
        start += r.extend_len
    assert torch.equal(pool.host[~changed], before[~changed])  # earlier positions and other rows untouched
    if page_size > 1:  # a request whose prefix ends inside a page continues that page
        assert int(pool.host[reqs[0].req_pool_idx, 9]) == int(reqs[0].slots[-1]) + 1
