"""PrefillAdder: picks the requests (and chunk sizes) of one prefill batch.

Budgets, all in tokens:
  - `max_prefill_tokens`: new tokens computed by the whole batch;
  - `chunked_prefill_size`: new tokens of one request per step (-1: no chunking);
  - memory: slots free or evictable, minus what running requests are expected to
    still need for decoding (`new_token_ratio` × their remaining max_new_tokens),
    so admitting a prompt rarely forces a retraction later.

A request that does not fit its whole remaining prompt under the budgets is
chunked: it computes a prefix now and continues in a later step. At most one
request per batch is chunked, and it is always the last one added.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from engine.memory.kv_cache_manager import KVCacheManager
from engine.request import Req

# Cap on the tokens reserved for one request's future decoding (SGLang uses the same idea).
MAX_RESERVED_NEW_TOKENS = 4096


def reserved_decode_tokens(req: Req, ratio: float) -> int:
    if req.handoff == "sender":  # decodes elsewhere
        return 0
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return int(min(max(remaining, 0), MAX_RESERVED_NEW_TOKENS) * ratio)


class PrefillAdder:
    def __init__(
        self,
        kv: KVCacheManager,
        running: List[Req],
        max_prefill_tokens: int,
        chunk_size: int,
        new_token_ratio: float,
        max_running: int,
        decoding: Sequence[Req] = (),
    ):
        """`decoding`: running requests that decode one token in the same (mixed) step; their tokens count
        against the step's budget and their new pages are kept free for them."""
        self.kv = kv
        self.page_size = kv.page_size
        self.ratio = new_token_ratio
        self.rem_batch_tokens = max_prefill_tokens - len(decoding)
        self.chunk_size = chunk_size
        self.rem_slots = max_running - len(running)
        self.rem_total = kv.available() - sum(reserved_decode_tokens(r, new_token_ratio) for r in running)
        self.can_run: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.no_running = not running
        self.batch_slots = sum(kv.pages_for(r, 1) for r in decoding) * self.page_size
        """New KV slots the batch's requests will take (kept free by evicting cache as requests are added)."""

    @property
    def full(self) -> bool:
        return self.chunked_req is not None or self.rem_batch_tokens <= 0 or self.rem_slots <= 0

    def add_one(self, req: Req, admitted: bool) -> bool:
        """Try to add `req`. `admitted`: it already holds its row and lock (a chunked request
        continuing). Returns False when it does not fit; nothing is changed then."""
        if self.full:
            return False
        prefix = req.kv_len if admitted else self.kv.match(req)
        remaining = req.seq_len - prefix
        extend = self._extend_len(prefix, remaining)
        finishes_prompt = extend == remaining
        need = self.kv.pages_for(req, extend) * self.page_size
        need += reserved_decode_tokens(req, self.ratio) if finishes_prompt else 0
        # Over the memory budget: wait, unless nothing else could make progress.
        if need > self.rem_total and (self.can_run or not self.no_running):
            return False
        if not admitted:
            if self.kv.req_to_token_pool.available_size() == 0:
                return False
            self.kv.admit(req)
        slots = self.kv.pages_for(req, extend) * self.page_size
        if not self.kv.ensure_free(self.batch_slots + slots):
            if not admitted:
                self.kv.release(req, cache=False)
            return False
        self.batch_slots += slots
        req.extend_len = extend
        self.can_run.append(req)
        self.rem_batch_tokens -= extend
        self.rem_total -= need
        self.rem_slots -= 0 if admitted else 1
        if not finishes_prompt:
            self.chunked_req = req
        return True

    def _extend_len(self, prefix: int, remaining: int) -> int:
        """New tokens this step: all that remain, or a chunk ending on a page boundary."""
        limit = self.rem_batch_tokens if self.chunk_size == -1 else min(self.rem_batch_tokens, self.chunk_size)
        if remaining <= limit:
            return remaining
        end = (prefix + limit) // self.page_size * self.page_size
        return min(remaining, max(end - prefix, self.page_size))
