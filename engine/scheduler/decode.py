"""Decode-side memory: make room for one more token per running request.

Before each decode step every running request whose next position starts a new
page needs one page. When the free list plus evictable cache cannot cover
that, requests are retracted, least progress first (fewest output tokens,
then longest prompt), as SGLang does: their computed KV is handed to the radix
cache (so resuming usually re-matches most of it), their row and lock are
released, and they go back to the waiting queue keeping their output so far.
Sampling is counter-based on (seed, output position), so a resumed request
continues with exactly the tokens it would have produced.
"""

from __future__ import annotations

from typing import List

from engine.memory.kv_cache_manager import KVCacheManager
from engine.outputs import FinishReason
from engine.request import Req


def pages_needed(running: List[Req], page_size: int) -> int:
    return sum(1 for r in running if r.kv_len % page_size == 0)


def retract_for_decode(running: List[Req], kv: KVCacheManager, output, context_len: int) -> List[Req]:
    """Retract requests from `running` (in place) until the rest can decode one token.

    Returns the retracted requests. A lone request that still cannot grow has
    outgrown the whole KV pool: it finishes with reason `length`.
    """
    retracted: List[Req] = []
    while running and not kv.ensure_free(pages_needed(running, kv.page_size) * kv.page_size):
        running.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        victim = running.pop()
        kv.release(victim, cache=True)
        victim.num_retractions += 1
        if not running:
            output.finish(victim, FinishReason.LENGTH)
        retracted.append(victim)
    return retracted
