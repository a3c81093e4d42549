"""RankedTransfer (cluster/kv_transfer/ranked.py) without Ray: a TP=2 engine (rank 1 in a process of its own) moves
KV pages rank to rank with a 2-rank peer made of two NIXL backends over host buffers in this process.

Checked: pages written into the engine arrive on each rank's own shard (rank 0's in this process is read back
directly) and the engine writes them back out rank by rank, unchanged; a peer of another tensor_parallel_size is
refused; a dead rank fails the transfers that wait on it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("nixl_cu13._api")

from cluster.kv_transfer import KVTransferError, kv_pool_buffers, make_backend  # noqa: E402
from cluster.kv_transfer.ranked import RankedPeerInfo, RankedTransfer  # noqa: E402
from engine.errors import EngineDeadError  # noqa: E402
from engine_harness import make_engine  # noqa: E402

PAGE = 4
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def setup():
    """(engine, its RankedTransfer, the peer's backend per rank, their buffers)."""
    engine = make_engine(page_size=PAGE, tensor_parallel_size=2, max_total_tokens=256)
    transfer = RankedTransfer("nixl", "tp-engine", engine, PAGE)
    peers, buffers = [], []
    for rank, info in enumerate(transfer.info().ranks):
        layout = info.layout
        buf = torch.zeros(layout.num_pages * PAGE, layout.page_bytes // PAGE // 4, dtype=torch.float32)
        buffers.append(buf)
        peers.append(make_backend("nixl", "peer" if rank == 0 else f"peer/rank{rank}", [buf], PAGE))
        peers[-1].connect(info)
    transfer.connect(RankedPeerInfo(tuple(p.info() for p in peers)))
    yield engine, transfer, peers, buffers
    transfer.close()
    for p in peers:
        p.close()
    engine.shutdown()


def test_pages_go_in_and_out_rank_by_rank(setup):
    engine, transfer, peers, buffers = setup
    ranks = transfer.info().ranks
    assert len(ranks) == 2  # SmolLM2's 3 KV heads: 2 on rank 0, 1 on rank 1
    assert ranks[0].layout.page_bytes == 2 * ranks[1].layout.page_bytes
    gen = torch.Generator().manual_seed(0)
    for buf in buffers:
        buf[PAGE : 3 * PAGE] = torch.rand(2 * PAGE, buf.shape[1], generator=gen)
    sent = [buf[PAGE : 3 * PAGE].clone() for buf in buffers]

    into = transfer.expect("peer", [5, 6], "in")
    writes = [p.write(r.name, [1, 2], [5, 6], "in") for p, r in zip(peers, ranks)]
    for p, h in zip(peers, writes):
        p.wait_sync(h, TIMEOUT_S)
    transfer.wait_sync(into, TIMEOUT_S)
    (pool,) = kv_pool_buffers(engine.runner.kv_pool)
    assert torch.equal(pool[5 * PAGE : 7 * PAGE], sent[0])  # rank 0's shard, here

    back = [p.expect(r.name, [9, 10], "out") for p, r in zip(peers, ranks)]
    out = transfer.write("peer", [5, 6], [9, 10], "out", message=b"first token")
    transfer.wait_sync(out, TIMEOUT_S)
    for p, h in zip(peers, back):
        p.wait_sync(h, TIMEOUT_S)
    assert back[0].message == b"first token" and back[1].message == b""
    for buf, want in zip(buffers, sent):
        assert torch.equal(buf[9 * PAGE : 11 * PAGE], want)  # rank 1's came back from its own process


def test_a_peer_of_another_tensor_parallel_size_is_refused(setup):
    _, transfer, peers, _ = setup
    with pytest.raises(KVTransferError, match="same tensor_parallel_size"):
        transfer.connect(peers[0].info())
    with pytest.raises(KVTransferError, match="same tensor_parallel_size"):
        transfer.connect(RankedPeerInfo((peers[0].info(),)))


def test_a_dead_rank_fails_the_transfer(setup):
    """A transfer waiting when rank 1 dies fails naming it; once the engine has stopped (it polls its ranks),
    a new transfer is refused at once with the engine's error, which names the rank too (a dead replica's
    error: the cluster retries the request elsewhere)."""
    engine, transfer, _, _ = setup
    tp = engine.runner.tp
    waiting = transfer.expect("peer", [12], "before-death")
    os.kill(tp.processes.pids[0], signal.SIGKILL)
    with pytest.raises(KVTransferError, match="rank 1"):
        transfer.wait_sync(waiting, TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S  # a guard against a hang, not a speed requirement
    while engine.core.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(EngineDeadError, match="rank 1"):
        transfer.expect("peer", [13], "after-death")
