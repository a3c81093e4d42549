"""Prefill/decode handoff at the engine level (engine.scheduler.handoff), two engines in one process: the
sender (`prefill`) and the receiver (`decode`).

The KV pages move with a plain in-process copy between the two engines' pools (the cluster moves
them with cluster.kv_transfer); what is checked here is the engine contract: greedy outputs equal
those of one engine doing both, seeded sampling continues identically, both sides reuse their
radix caches, and aborts at every stage leak nothing on either side.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_harness import PROMPTS, assert_no_leak, make_engine

PAGE = 4


def copy_pages(src_engine, dst_engine, src_pages, dst_pages) -> None:
    """Copy whole KV pages, every layer, K and V: src pool pages → dst pool pages."""
    src, dst = src_engine.runner.kv_pool, dst_engine.runner.kv_pool
    assert len(src_pages) == len(dst_pages)
    for bufs_src, bufs_dst in ((src.k_buffers, dst.k_buffers), (src.v_buffers, dst.v_buffers)):
        for a, b in zip(bufs_src, bufs_dst):
            a_pages = a.view(-1, PAGE, *a.shape[1:])
            b_pages = b.view(-1, PAGE, *b.shape[1:])
            b_pages[list(dst_pages)] = a_pages[list(src_pages)]


@pytest.fixture(scope="module")
def engines():
    unified = make_engine(page_size=PAGE)
    prefill = make_engine(page_size=PAGE)
    decode = make_engine(page_size=PAGE)
    yield unified, prefill, decode
    for e in (unified, prefill, decode):
        e.shutdown()


def wait_idle(engine) -> None:
    """Aborts are applied at the engine's next step: wait (bounded) until nothing is in flight."""
    for _ in range(200):
        s = engine.stats()
        if s.handoff_in_flight == 0 and s.running == 0 and s.waiting == 0:
            return
        time.sleep(0.01)


async def disaggregated(prefill, decode, prompt, params, rid, fail_at=None):
    """Run one request: the receiver reserves pages, the sender computes and hands over, the receiver streams."""
    seen = {}

    async def remote_prefill(reservation):
        seen["reservation"] = reservation
        if fail_at == "before_prefill":
            raise RuntimeError("prefill replica died")
        p = dict(params, seed=reservation.seed)
        handoff = await prefill.prefill_for_handoff(prompt, p, rid=rid)
        try:
            seen["handoff"] = handoff
            if fail_at == "transfer":
                raise TimeoutError("transfer timed out")
            copy_pages(prefill, decode, handoff.pages_from(reservation.prefix_len), reservation.dst_pages)
        finally:
            prefill.release_handoff(rid)
        return handoff

    tokens, text, last = [], "", None
    async for out in decode.generate_stream(prompt, params, rid=rid, remote_prefill=remote_prefill):
        tokens += out.new_token_ids
        text += out.text
        last = out
    return tokens, text, last, seen


def test_greedy_outputs_identical_to_unified(engines):
    unified, prefill, decode = engines
    params = dict(max_new_tokens=24, temperature=0.0)
    want = [o.token_ids for o in unified.generate(PROMPTS, params)]

    async def run_all():
        return await asyncio.gather(
            *(disaggregated(prefill, decode, p, params, f"g{i}") for i, p in enumerate(PROMPTS))
        )

    got = asyncio.run(run_all())
    assert [g[0] for g in got] == want
    assert [g[1] for g in got] == [o.text for o in unified.generate(PROMPTS, params)]
    for e in (prefill, decode):
        wait_idle(e)
        assert_no_leak(e)


def copy_rows(src_engine, dst_engine, src_pages, dst_pages) -> None:
    """Copy whole KV pages through each engine's kv_pool_rows (the memory a KV transfer backend registers)."""
    src, dst = src_engine.kv_pool_rows(), dst_engine.kv_pool_rows()
    src_p, dst_p = src.view(-1, PAGE, src.shape[1]), dst.view(-1, PAGE, dst.shape[1])
    dst_p[list(dst_pages)] = src_p[list(src_pages)]
    if dst.is_cuda:  # the copy is this process's work: done before the receiver's core reads the pages
        import torch

        torch.cuda.synchronize(dst.device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cores_in_processes_hand_over_through_their_mapped_pools(engines, device):
    """core_process + share_kv_pool: each core's pool is mapped into this process (CPU: a shared-memory
    segment, CUDA: CUDA IPC), and pages copied through the mappings give the greedy tokens of one engine doing
    both; CPU segments go with the engines."""
    import os

    unified = engines[0] if device == "cpu" else make_engine(page_size=PAGE, device=device)
    prefill = make_engine(page_size=PAGE, device=device, core_process=True, share_kv_pool=True)
    decode = make_engine(page_size=PAGE, device=device, core_process=True, share_kv_pool=True)
    try:
        params = dict(max_new_tokens=24, temperature=0.0)
        want = unified.generate(PROMPTS, params)
        rows = prefill.kv_pool_rows()
        assert rows.shape[0] == prefill.stats().kv_total_tokens + PAGE  # + the reserved page 0
        assert rows.device.type == device
        segments = [e.core.call("export_kv_pool").shm_name for e in (prefill, decode)]
        assert all(os.path.exists(f"/dev/shm/{name}") for name in segments) == (device == "cpu")

        async def one(prompt, rid):
            async def remote_prefill(reservation):
                handoff = await prefill.prefill_for_handoff(prompt, params, rid=rid)
                try:
                    copy_rows(prefill, decode, handoff.pages_from(reservation.prefix_len), reservation.dst_pages)
                finally:
                    prefill.release_handoff(rid)
                return handoff

            tokens, text = [], ""
            async for out in decode.generate_stream(prompt, params, rid=rid, remote_prefill=remote_prefill):
                tokens += out.new_token_ids
                text += out.text
            return tokens, text

        async def run_all():
            return await asyncio.gather(*(one(p, f"pc{i}") for i, p in enumerate(PROMPTS)))

        got = asyncio.run(run_all())
        assert [g[0] for g in got] == [o.token_ids for o in want]
        assert [g[1] for g in got] == [o.text for o in want]
        for e in (prefill, decode):
            wait_idle(e)
            assert_no_leak(e)
    finally:
        prefill.shutdown()
        decode.shutdown()
        if unified is not engines[0]:
            unified.shutdown()
    assert not any(name and os.path.exists(f"/dev/shm/{name}") for name in segments)


def test_unshared_pool_in_a_core_process_is_refused():
    """Without share_kv_pool a CPU pool in a core process cannot be mapped: a clear error, not a crash."""
    engine = make_engine(page_size=PAGE, core_process=True)
    try:
        with pytest.raises(RuntimeError, match="share_kv_pool"):
            engine.kv_pool_rows()
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_seeded_sampling_and_logprobs_continue_identically(engines):
    unified, prefill, decode = engines
    params = dict(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=1234, logprobs=True, top_logprobs=2)
    want = unified.generate(PROMPTS[3], params)
    tokens, _, _, seen = asyncio.run(disaggregated(prefill, decode, PROMPTS[3], params, "seeded"))
    assert tokens == want.token_ids
    assert seen["handoff"].first_logprob.token_id == tokens[0]
    assert seen["handoff"].first_logprob.logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-5)


def test_both_sides_reuse_their_caches(engines):
    _, prefill, decode = engines
    system = "You are a careful assistant. " * 12
    params = dict(max_new_tokens=4, temperature=0.0)
    asyncio.run(disaggregated(prefill, decode, system + "Question one?", params, "c1"))
    _, _, last, seen = asyncio.run(disaggregated(prefill, decode, system + "Question two?", params, "c2"))
    assert seen["reservation"].prefix_len > 0  # decode matched its own cache: less to transfer
    assert seen["handoff"].cached_tokens > 0  # prefill reused its cache
    assert last.cached_tokens == seen["handoff"].cached_tokens
    assert seen["reservation"].prefix_len % PAGE == 0
    assert len(seen["reservation"].dst_pages) == -(
        -(seen["reservation"].prompt_len - seen["reservation"].prefix_len) // PAGE
    )


@pytest.mark.parametrize("fail_at", ["before_prefill", "transfer"])
def test_failures_free_every_page_on_both_sides(engines, fail_at):
    _, prefill, decode = engines
    with pytest.raises((RuntimeError, TimeoutError)):
        asyncio.run(
            disaggregated(prefill, decode, PROMPTS[0] * 3, dict(max_new_tokens=8), f"f-{fail_at}", fail_at=fail_at)
        )
    for e in (prefill, decode):
        wait_idle(e)
        assert_no_leak(e)
        assert e.stats().handoff_in_flight == 0
    # Both still serve.
    tokens, *_ = asyncio.run(disaggregated(prefill, decode, PROMPTS[0], dict(max_new_tokens=4), "after"))
    assert len(tokens) == 4


def test_client_cancel_while_waiting_for_prefill(engines):
    """The decode stream is cancelled while the prefill runs: its reserved pages are freed; the sender's
    own cancellation aborts its request."""
    _, prefill, decode = engines

    async def main():
        started = asyncio.Event()

        async def slow_prefill(reservation):
            started.set()
            await asyncio.sleep(30)

        async def consume():
            async for _ in decode.generate_stream(
                PROMPTS[1], dict(max_new_tokens=8), rid="cancel", remote_prefill=slow_prefill
            ):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 30)
        assert decode.stats().handoff_in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        ptask = asyncio.ensure_future(
            prefill.prefill_for_handoff(PROMPTS[2] * 4, dict(max_new_tokens=8), rid="pcancel")
        )
        await asyncio.sleep(0)
        ptask.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ptask

    asyncio.run(main())
    for e in (prefill, decode):
        wait_idle(e)
        assert_no_leak(e)


def test_n_greater_than_one_is_rejected(engines):
    _, prefill, decode = engines
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        asyncio.run(prefill.prefill_for_handoff(PROMPTS[0], dict(n=2)))
