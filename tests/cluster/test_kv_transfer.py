"""KV page transfer between two OS processes: NIXL over host memory (CPU), NCCL on 2 GPUs.

The test process runs the sender (as a prefill replica does); a spawned child runs the receiver (as a
decode replica does, over a pool of a different size). Data is checked page by page on the receiver: dst pages
hold the sender's src pages, every other page is untouched.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest
import torch

from cluster.kv_transfer import (
    MAX_MESSAGE_BYTES,
    KVTransferError,
    KVTransferTimeout,
    PageRun,
    TransferStatus,
    kv_pool_buffers,
    make_backend,
    page_runs,
)
from kv_transfer_harness import NUM_LAYERS, PAGE_SIZE, PeerProcess, fill, make_pool

SENDER_PAGES, RECEIVER_PAGES = 64, 48
_ids = itertools.count()


def _tid() -> str:
    return f"t{next(_ids)}"


def _check_received(received: list[torch.Tensor], sent: list[torch.Tensor], src, dst) -> None:
    """dst pages equal the sent src pages in every buffer; all other pages are still zero."""
    for r, s in zip(received, sent, strict=True):
        r_pages = r.view(-1, PAGE_SIZE, *r.shape[1:])
        s_pages = s.view(-1, PAGE_SIZE, *s.shape[1:])
        wrong = [d for d, s_ in zip(dst, src) if not torch.equal(r_pages[d], s_pages[s_])]
        assert not wrong, f"dst pages {wrong} do not hold their src pages"
        untouched = torch.ones(r_pages.shape[0], dtype=torch.bool)
        untouched[list(dst)] = False
        assert not r_pages[untouched].any()


def _random_pages(rng: np.random.Generator, num_pages: int, n: int) -> list[int]:
    """n distinct pages in [1, num_pages) in random order, with one consecutive run of 5 inside."""
    start = int(rng.integers(1, num_pages - 5))
    rest = rng.permutation(np.setdiff1d(np.arange(1, num_pages), np.arange(start, start + 5)))[: n - 5]
    at = int(rng.integers(0, n - 5))
    return [int(p) for p in rest[:at]] + list(range(start, start + 5)) + [int(p) for p in rest[at:]]


@pytest.fixture(scope="module")
def nixl_pair():
    """(sender backend, its buffers, receiver PeerProcess), connected both ways."""
    pool = make_pool(SENDER_PAGES)
    buffers = kv_pool_buffers(pool)
    fill(buffers, seed=1)
    sender = make_backend("nixl", "prefill-0", buffers, PAGE_SIZE)
    receiver = PeerProcess("nixl", "decode-0", RECEIVER_PAGES)
    try:
        receiver.call("connect", sender.info())
        sender.connect(receiver.call("info"))
        yield sender, buffers, receiver
    finally:
        receiver.close()
        sender.close()


def test_poll_delay_is_short_at_first_then_a_bounded_share_of_the_wait():
    """A transfer's first 20 ms are polled at most 0.2 ms apart; later polls are at most 1% of the time
    waited so far apart (at most 2 ms), and the delay never shrinks while the wait goes on."""
    from cluster.kv_transfer.base import poll_delay

    delay, waited, delays = 0.0, 0.0, []
    while waited < 5.0:
        delay = poll_delay(delay, waited)
        delays.append((waited, delay))
        waited += delay + 1e-5  # the poll itself
    assert delays[0][1] == 5e-5 and all(b >= a for (_, a), (_, b) in zip(delays, delays[1:]))
    assert all(d <= 2e-4 for w, d in delays if w < 0.02)
    assert all(d <= max(2e-4, w / 100) for w, d in delays) and max(d for _, d in delays) == 2e-3
    assert len(delays) < 5000  # a 5 s wait: thousands of polls, not 25,000


def test_page_runs_coalesce_consecutive_pages_on_both_sides():
    src = np.array([3, 4, 5, 9, 10, 2])
    dst = np.array([7, 8, 9, 1, 11, 12])
    assert page_runs(src, dst) == [PageRun(3, 7, 3), PageRun(9, 1, 1), PageRun(10, 11, 1), PageRun(2, 12, 1)]
    assert page_runs(np.arange(1, 9), np.arange(20, 28)) == [PageRun(1, 20, 8)]
    with pytest.raises(KVTransferError, match="differ in length"):
        page_runs(np.array([1, 2]), np.array([1]))


def _reference_runs(src: np.ndarray, dst: np.ndarray) -> list[PageRun]:
    """Maximal runs consecutive on both sides, one pair at a time (the definition page_runs implements)."""
    runs: list[PageRun] = []
    for s, d in zip(src.tolist(), dst.tolist()):
        last = runs[-1] if runs else None
        if last and s == last.src_start + last.length and d == last.dst_start + last.length:
            runs[-1] = PageRun(last.src_start, last.dst_start, last.length + 1)
        else:
            runs.append(PageRun(s, d, 1))
    return runs


def test_page_runs_match_the_definition_on_single_runs_and_scattered_pages():
    """The one-run fast path (both sides consecutive) and the general path agree with the pairwise definition,
    including near misses of the fast path: equal spans but a gap and a repeat, or a descending side."""
    rng = np.random.default_rng(7)
    cases = [
        (np.arange(5, 37), np.arange(100, 132)),
        (np.array([4]), np.array([9])),
        (np.array([1, 2, 4, 4]), np.array([10, 11, 12, 13])),  # span 3 over 4 pages, not increasing
        (np.array([1, 3, 2, 4]), np.array([10, 11, 12, 13])),
        (np.arange(8, 0, -1), np.arange(1, 9)),
        (np.arange(1, 9), np.array([1, 2, 3, 4, 6, 7, 8, 5])),
    ]
    for _ in range(50):
        n = int(rng.integers(1, 40))
        src = np.sort(rng.choice(np.arange(1, 200), n, replace=False)) if rng.random() < 0.5 else np.arange(1, n + 1)
        dst = np.arange(50, 50 + n) if rng.random() < 0.5 else rng.permutation(np.arange(1, n + 1))
        cases.append((src, dst))
    for src, dst in cases:
        src, dst = src.astype(np.int64), dst.astype(np.int64)
        assert page_runs(src, dst) == _reference_runs(src, dst), (src, dst)


def test_page_checks_reject_bad_ids_on_both_paths():
    """Bounds and duplicates are caught whether the ids are increasing (checked at the ends) or not."""
    from cluster.kv_transfer.base import check_pages

    for pages in ([0, 1, 2], [5, 6, 40], [6, 0, 5], [40, 2]):
        with pytest.raises(KVTransferError, match="outside"):
            check_pages(np.array(pages, dtype=np.int64), 40, "p", unique=True)
    with pytest.raises(KVTransferError, match="duplicate"):
        check_pages(np.array([3, 5, 3], dtype=np.int64), 40, "p", unique=True)
    check_pages(np.array([3, 5, 3], dtype=np.int64), 40, "p", unique=False)  # a sender may send a page twice
    check_pages(np.array([1, 2, 39], dtype=np.int64), 40, "p", unique=True)


def test_descriptor_rows_are_the_same_as_list_or_array():
    """nixl._run_rows builds few regions as tuples and many as one array: same rows, buffer-major."""
    nixl = pytest.importorskip("cluster.kv_transfer.nixl")
    rng = np.random.default_rng(1)
    for regions in (1, 5, nixl._LIST_ROWS_MAX, nixl._LIST_ROWS_MAX + 1, 200):
        for bases in ([1 << 40], [1 << 40, 1 << 41]):
            starts, lengths = rng.integers(1, 1000, regions), rng.integers(1, 9, regions)
            rows = nixl._run_rows(bases, starts, lengths, 4096, 3)
            want = [(b + 4096 * int(s), 4096 * int(n), 3) for b in bases for s, n in zip(starts, lengths)]
            assert [tuple(int(v) for v in row) for row in rows] == want
            assert isinstance(rows, list) == (len(want) <= nixl._LIST_ROWS_MAX)


def test_nixl_random_pages_arrive_with_notification(nixl_pair):
    sender, buffers, receiver = nixl_pair
    rng = np.random.default_rng(0)
    src = _random_pages(rng, SENDER_PAGES, 30)
    dst = _random_pages(rng, RECEIVER_PAGES, 30)
    t1, t2 = _tid(), _tid()
    # Two transfers in flight, expected in one order and written in the other.
    receiver.start_call("expect_many", "prefill-0", [(dst[:20], t1), (dst[20:], t2)], 30.0)
    handles = [
        sender.write("decode-0", src[20:], dst[20:], t2, message=b"second \x00\xff|"),
        sender.write("decode-0", src[:20], dst[:20], t1),
    ]
    assert handles[1].nbytes == 20 * sender.layout.page_bytes * sender.layout.num_buffers
    for handle in handles:
        asyncio.run(sender.wait(handle, 30.0))
    # returns only once both notifications arrived, each with its own message (binary-safe)
    assert receiver.finish_call() == [b"", b"second \x00\xff|"]
    assert all(h.released for h in handles) and not sender._live
    _check_received(receiver.call("buffers_cpu"), buffers, src, dst)

    # The notification may also come before the receiver expects it (torch tensors as page lists).
    free = sorted(set(range(1, RECEIVER_PAGES)) - set(dst), reverse=True)
    src2, dst2 = torch.tensor([60, 61, 62]), torch.tensor(free[:3])  # descending: three runs
    tid = _tid()
    sender.wait_sync(sender.write("decode-0", src2, dst2, tid, message=b"m" * MAX_MESSAGE_BYTES), 30.0)
    assert receiver.call("expect", "prefill-0", dst2, tid, 30.0) == b"m" * MAX_MESSAGE_BYTES
    _check_received(receiver.call("buffers_cpu"), buffers, src + src2.tolist(), dst + dst2.tolist())
    assert receiver.call("live_handles") == 0


def test_nixl_shared_worker_path_still_moves_pages():
    """num_threads=0 (RADIXSERVE_NIXL_THREADS=0) keeps NIXL's shared worker and progress thread; a sender on that
    path reaches a receiver on the default dedicated worker with data and message intact. A negative thread
    count is refused."""
    pool = make_pool(16)
    buffers = kv_pool_buffers(pool)
    fill(buffers, seed=3)
    with pytest.raises(KVTransferError, match="threads"):
        make_backend("nixl", "prefill-bad-threads", buffers, PAGE_SIZE, num_threads=-1)
    sender = make_backend("nixl", "prefill-shared", buffers, PAGE_SIZE, num_threads=0)
    receiver = PeerProcess("nixl", "decode-shared", 16)
    try:
        assert sender.num_threads == 0
        receiver.call("connect", sender.info())
        sender.connect(receiver.call("info"))
        src, dst = [10, 11, 12, 13, 2], [3, 4, 5, 6, 7]
        tid = _tid()
        sender.wait_sync(sender.write("decode-shared", src, dst, tid, message=b"shared"), 30.0)
        assert receiver.call("expect", "prefill-shared", dst, tid, 30.0) == b"shared"
        _check_received(receiver.call("buffers_cpu"), buffers, src, dst)
    finally:
        receiver.close()
        sender.close()


def test_nixl_moves_pages_of_a_mapped_shared_pool():
    """A disaggregated worker whose core runs in its own process registers the core's pool as mapped into the
    worker (KVPool.export → map_kv_pool; on CPU a shared-memory segment mapped at another address): NIXL sends
    from such a mapping the owner's pages, and what it receives into one is what the owner reads."""
    from engine.memory.kv_pool import KVPool, map_kv_pool

    owner = KVPool(16 * PAGE_SIZE, NUM_LAYERS, 2, 8, torch.float32, torch.device("cpu"), shared=True)
    mapped = map_kv_pool(owner.export())
    rows = mapped.slot_rows()
    assert rows.data_ptr() != owner.slot_rows().data_ptr()
    fill([owner.slot_rows()], seed=1)
    backend = make_backend("nixl", "prefill-mapped", [rows], PAGE_SIZE)
    peer = PeerProcess("nixl", "decode-mapped", 16)
    try:
        peer.call("connect", backend.info())
        backend.connect(peer.call("info"))
        src, dst, tid = [10, 11, 12, 2], [3, 4, 5, 6], _tid()
        backend.wait_sync(backend.write("decode-mapped", src, dst, tid), 30.0)
        assert peer.call("expect", "prefill-mapped", dst, tid, 30.0) == b""
        _check_received(peer.call("buffers_cpu"), [owner.slot_rows()], src, dst)

        # The other way: the peer writes into the mapping; the owner's tensor holds the pages.
        peer.call("fill", 5)
        want = peer.call("buffers_cpu")[0].view(-1, PAGE_SIZE, rows.shape[1])
        owner.slot_rows().zero_()
        src, dst, tid = [7, 8], [12, 1], _tid()
        handle = backend.expect("decode-mapped", dst, tid)
        peer.call("write", "prefill-mapped", src, dst, tid, 30.0)
        backend.wait_sync(handle, 30.0)
        got = owner.slot_rows().view(-1, PAGE_SIZE, rows.shape[1])
        assert torch.equal(got[dst], want[src])
    finally:
        peer.close()
        backend.close()
        owner.close()


@pytest.mark.gpu
def test_nixl_moves_pages_of_a_cuda_pool_mapped_from_another_process():
    """The GPU form of the mapped pool: the owner's CUDA pool (another process, as an engine core process) mapped
    here through CUDA IPC, registered with NIXL, sends the owner's pages and receives into the owner's pool."""
    from engine.memory.kv_pool import map_kv_pool

    owner = PeerProcess("nixl", "owner-cuda", 16, device="cuda:0")
    peer = PeerProcess("nixl", "decode-cuda", 16, device="cuda:0")
    backend = None
    try:
        owner.call("fill", 2)
        rows = map_kv_pool(owner.call("export")).slot_rows()
        assert rows.is_cuda
        backend = make_backend("nixl", "prefill-cuda-mapped", [rows], PAGE_SIZE)
        peer.call("connect", backend.info())
        backend.connect(peer.call("info"))
        src, dst, tid = [10, 11, 12, 2], [3, 4, 5, 6], _tid()
        backend.wait_sync(backend.write("decode-cuda", src, dst, tid), 30.0)
        assert peer.call("expect", "prefill-cuda-mapped", dst, tid, 30.0) == b""
        _check_received(peer.call("buffers_cpu"), owner.call("buffers_cpu"), src, dst)

        peer.call("fill", 5)
        want = peer.call("buffers_cpu")[0].view(-1, PAGE_SIZE, rows.shape[1])
        src, dst, tid = [7, 8], [13, 1], _tid()
        handle = backend.expect("decode-cuda", dst, tid)
        peer.call("write", "prefill-cuda-mapped", src, dst, tid, 30.0)
        backend.wait_sync(handle, 30.0)
        got = owner.call("buffers_cpu")[0].view(-1, PAGE_SIZE, rows.shape[1])
        assert torch.equal(got[dst], want[src])
    finally:
        if backend is not None:
            backend.close()
        peer.close()
        owner.close()


def test_nixl_moves_one_region_per_page_run_of_a_token_major_pool(nixl_pair):
    _, _, receiver = nixl_pair
    pool = make_pool(16)
    sender = make_backend("nixl", "prefill-telemetry", kv_pool_buffers(pool), PAGE_SIZE, capture_telemetry=True)
    try:
        receiver.call("connect", sender.info())
        sender.connect(receiver.call("info"))
        src, dst = [3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 11, 12]  # runs: 3-5→7-9, 9→1, 10→11, 2→12
        handle = sender.write("decode-0", src, dst, _tid())
        while sender.poll(handle) is TransferStatus.PENDING:
            time.sleep(0.001)
        assert sender.poll(handle) is TransferStatus.DONE
        # The pool is token-major: one buffer, so a run is one region across all layers' K and V.
        assert sender.layout.num_buffers == 1
        assert sender.layout.page_bytes == PAGE_SIZE * pool.bytes_per_token(
            NUM_LAYERS, pool.num_kv_heads, pool.head_dim, pool.dtype
        )
        assert sender.regions(handle) == len(page_runs(np.array(src), np.array(dst))) == 4
        sender.release(handle)
    finally:
        sender.close()


def test_nixl_receiver_rejects_a_write_to_other_pages(nixl_pair):
    sender, _, receiver = nixl_pair
    tid = _tid()
    receiver.start_call("expect", "prefill-0", [30, 31], tid, 30.0)
    sender.wait_sync(sender.write("decode-0", [1, 2], [30, 32], tid), 30.0)
    with pytest.raises(KVTransferError, match="digest mismatch"):
        receiver.finish_call()


def test_nixl_expect_never_written_times_out_and_releases(nixl_pair):
    sender, _, receiver = nixl_pair
    with pytest.raises(KVTransferTimeout):
        receiver.call("expect", "prefill-0", [5], _tid(), 0.3)
    assert receiver.call("live_handles") == 0
    handle = sender.expect("decode-0", [5], _tid())
    with pytest.raises(KVTransferTimeout):
        asyncio.run(sender.wait(handle, 0.2))
    assert handle.released and not sender._live
    with pytest.raises(KVTransferError, match="already released"):
        sender.poll(handle)
    sender.release(handle)  # idempotent


@pytest.mark.parametrize(
    "src, dst, match",
    [
        ([1, 2], [3], "lengths must match"),
        ([0, 2], [3, 4], r"outside \[1, 64\)"),
        ([1, 64], [3, 4], r"outside \[1, 64\)"),
        ([1, 2], [3, 48], r"outside \[1, 48\)"),  # the peer's pool is smaller
        ([1, 2], [-1, 4], "outside"),
        ([1, 2], [4, 4], "duplicate"),
        ([1, 2, 3], [5, 9, 5], "duplicate"),  # not increasing: the sorting check
        ([], [], "empty"),
        ([[1, 2]], [[3, 4]], "1-D"),
        ([1.5], [3], "integers"),
    ],
)
def test_nixl_invalid_pages_raise(nixl_pair, src, dst, match):
    sender, _, _ = nixl_pair
    with pytest.raises(KVTransferError, match=match):
        sender.write("decode-0", src, dst, _tid())
    assert not sender._live


def test_nixl_invalid_peers_ids_and_layouts_raise(nixl_pair):
    sender, _, receiver = nixl_pair
    with pytest.raises(KVTransferError, match="unknown peer 'decode-9'"):
        sender.write("decode-9", [1], [1], _tid())
    with pytest.raises(KVTransferError, match="unknown peer"):
        sender.expect("decode-9", [1], _tid())
    with pytest.raises(KVTransferError, match="transfer_id"):
        sender.expect("decode-0", [1], "")
    with pytest.raises(KVTransferError, match="message must be bytes of at most"):
        sender.write("decode-0", [1], [1], _tid(), message=b"x" * (MAX_MESSAGE_BYTES + 1))
    assert not sender._live
    handle = sender.expect("decode-0", [1], "same-id")
    with pytest.raises(KVTransferError, match="already in flight"):
        sender.expect("decode-0", [2], "same-id")
    sender.release(handle)

    other = make_backend("nixl", "decode-bf16", kv_pool_buffers(make_pool(8, dtype=torch.bfloat16)), PAGE_SIZE)
    try:
        with pytest.raises(KVTransferError, match="page_bytes: local 1024 vs peer 512.*dtype"):
            sender.connect(other.info())
    finally:
        other.close()
    with pytest.raises(KVTransferError, match="own name"):
        sender.connect(sender.info())
    with pytest.raises(KVTransferError, match="page_size"):
        make_backend("nixl", "x", kv_pool_buffers(make_pool(8)), 3)
    with pytest.raises(KVTransferError, match="unknown KV transfer backend"):
        make_backend("carrier-pigeon", "x", kv_pool_buffers(make_pool(8)), PAGE_SIZE)
    sender.connect(receiver.call("info"))  # idempotent: same instance, nothing changes


def test_nccl_rejects_cpu_buffers():
    with pytest.raises(KVTransferError, match="CUDA"):
        make_backend("nccl", "x", kv_pool_buffers(make_pool(8)), PAGE_SIZE)


def test_nixl_write_to_dead_peer_fails_within_bound_and_releases():
    pool = make_pool(16)
    fill(kv_pool_buffers(pool), seed=2)
    sender = make_backend("nixl", "prefill-dead", kv_pool_buffers(pool), PAGE_SIZE)
    receiver = PeerProcess("nixl", "decode-dead", 16)
    try:
        receiver.call("connect", sender.info())
        sender.connect(receiver.call("info"))
        sender.wait_sync(sender.write("decode-dead", [1, 2], [3, 4], _tid()), 30.0)  # connection is up
        receiver.kill()
        handle = sender.write("decode-dead", list(range(1, 16)), list(range(1, 16)), _tid())
        with pytest.raises(KVTransferError):  # a failure or a KVTransferTimeout, whichever UCX sees first
            asyncio.run(sender.wait(handle, 5.0))
        assert handle.released and not sender._live
    finally:
        receiver.close()
        sender.close()


@pytest.mark.gpu
def test_nccl_random_pages_between_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    torch.cuda.set_device(0)
    pool = make_pool(SENDER_PAGES, device="cuda:0")
    buffers = kv_pool_buffers(pool)
    fill(buffers, seed=3)
    sender = make_backend("nccl", "prefill-nccl", buffers, PAGE_SIZE)
    receiver = PeerProcess("nccl", "decode-nccl", RECEIVER_PAGES, device="cuda:1")
    try:
        receiver.call("connect", sender.info())
        sender.connect(receiver.call("info"))
        rng = np.random.default_rng(1)
        src = _random_pages(rng, SENDER_PAGES, 30)
        dst = _random_pages(rng, RECEIVER_PAGES, 30)
        # Two transfers expected in one order and written in the other: NCCL matches by order,
        # the backend by transfer id.
        receiver.start_call("expect_many", "prefill-nccl", [(dst[:20], "n1"), (dst[20:], "n2")], 60.0)
        handles = [
            sender.write("decode-nccl", src[20:], dst[20:], "n2", message=b"\x00two"),
            sender.write("decode-nccl", src[:20], dst[:20], "n1"),
        ]
        for handle in handles:
            sender.wait_sync(handle, 60.0)
        assert receiver.finish_call() == [b"", b"\x00two"]
        assert not sender._live and receiver.call("live_handles") == 0
        _check_received(receiver.call("buffers_cpu"), [b.cpu() for b in buffers], src, dst)
    finally:
        receiver.close()
        sender.close()
