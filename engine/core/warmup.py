"""Warm-up: compile what compiles on first use before the first user's request (EngineConfig.warmup).

On CUDA some kernels are built the first time a step needs them, not when the model loads: FlashInfer's
prefill modules (JIT builds of tens of seconds each on a machine whose cache is cold; with a "ragged-*"
prompt-row kernel, the ragged module for steps without a cached prefix and the paged one for steps with
one: A's prefill needs the first, the mixed step below the second), and Triton kernels for
the shapes of eager prefill and mixed steps and for sampling with temperature / top-p / top-k. CUDA graph
capture at start-up covers only decode steps and the non-attention work of small prefill steps. Without a
warm-up the first request a server takes waits for those builds.

`warm_up` runs three requests through the scheduler, as requests from a user would run:

    A  a prompt longer than the piecewise-graph limit, greedy, 4 tokens: an eager prefill of 600 tokens
    B  A's prompt + 40 tokens, sampled with temperature, top-p and top-k, and
    C  a new prompt of 599 tokens, greedy; both once A is decoding: with mixed chunks, one eager step of
       640 tokens (A's decode, B's 40 beyond A's cached prefix, C's 599), then decode steps of three

and then leaves nothing behind: their outputs go nowhere, the radix cache is emptied (its events are
dropped, so a router never hears of these prompts) and the scheduler's counters and the device clock
start from zero. KV pages: every page is free again, or warm_up raises RuntimeError (a leak is a bug).
Outputs of later requests do not depend on it: greedy tokens are those of an engine that never warmed up.

Triton specializes a kernel on whether its integer arguments are multiples of 16, so the two eager steps
(600 and 640 tokens) compile both variants of the eager step's kernels.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, List

from engine.outputs import ReqOutput
from engine.request import Req
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from engine.core.core import EngineCore

PROMPT_TOKENS = 600
"""Warm-up prompt A: above the default piecewise-graph limit (512), so its prefill runs eagerly."""
EXTRA_TOKENS = 40
"""B = A + this many tokens (C: PROMPT_TOKENS - 1, so that A's decode, B's and C's tokens make 640)."""
MAX_STEPS = 10_000
"""A bound on the scheduler steps of the warm-up (it needs a few dozen)."""


def wanted(config, device) -> bool:
    """EngineConfig.warmup, on a CUDA device (on the CPU nothing compiles on first use)."""
    return bool(config.warmup) and device.type == "cuda"


def warm_up(core: "EngineCore") -> float:
    """Run the warm-up requests through `core`'s scheduler (its loop not started yet); returns seconds."""
    start = time.perf_counter()
    runner, scheduler = core.runner, core.scheduler
    n = max(2, min(PROMPT_TOKENS, runner.context_len - EXTRA_TOKENS - 16, runner.allocator.size // 8))
    extra = max(0, min(EXTRA_TOKENS, runner.context_len - n - 8))
    vocab = runner.vocab_size
    prompt = [(7 + 31 * i) % vocab for i in range(n + extra)]
    outputs: List[ReqOutput] = []
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=min(50, vocab), max_new_tokens=4, ignore_eos=True)

    def req(name: str, ids: List[int], params: SamplingParams, seed: int) -> Req:
        return Req(f"warmup-{name}", ids, params, seed=seed, eos_token_ids=frozenset(), on_output=outputs.append)

    a = req("a", prompt[:n], greedy, 0)
    later = [req("c", [(11 + 17 * i) % vocab for i in range(n - 1)], greedy, 2)]
    if extra:
        later.insert(0, req("b", prompt, sampled, 1))
    scheduler.add_request(a)
    steps = 0
    while scheduler.has_work or later:
        if later and a.output_ids:  # A decodes: B and C are prefilled beside it (a mixed step)
            for r in later:
                scheduler.add_request(r)
            later = []
        scheduler.step()
        steps += 1
        if steps > MAX_STEPS:
            raise RuntimeError(f"warm-up did not finish in {MAX_STEPS} steps")
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"warm-up request failed: {errors[0]!r}") from errors[0]
    core.tree_cache.reset()
    core.tree_cache.drain_events()
    scheduler.reset_stats()
    alloc = runner.allocator
    if alloc.available_size() != alloc.size:
        raise RuntimeError(f"warm-up left {alloc.size - alloc.available_size()} KV slots in use")
    return time.perf_counter() - start
