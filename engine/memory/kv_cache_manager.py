"""KVCacheManager: every change of KV ownership between requests and the RadixCache.

Ownership per request (see engine.request): positions [0, prefix_len) belong to
the tree and are locked through `req.last_node`; positions [prefix_len, kv_len)
belong to the request. This module keeps that invariant through admission,
extension, caching of partial work, and release, so that

    allocator.available_size() + tree.total_size() + Σ running (kv_len - prefix_len) rounded to pages
        == allocator.size

holds at every step (tests check it via `engine.stats()`).

Every slot index this module handles is a host tensor (allocator, radix cache, the host copy of the
request → slot table), so planning, caching and freeing never wait for the device.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from engine.memory.allocator import TokenToKVPoolAllocator
from engine.memory.radix_cache import RadixCache
from engine.memory.req_to_token import ReqToTokenPool
from engine.request import Req


class KVCacheManager:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree: RadixCache,
        page_size: int,
        disable_radix_cache: bool,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree = tree
        self.page_size = page_size
        self.use_tree = not disable_radix_cache

    # ---- sizes -----------------------------------------------------------------
    def available(self) -> int:
        """Token slots free now or freeable by eviction."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def pages_for(self, req: Req, extend_len: int) -> int:
        """New pages `req` needs to extend its KV by extend_len tokens."""
        ps = self.page_size
        room = (ps - req.kv_len % ps) % ps
        return -(-max(0, extend_len - room) // ps)

    def ensure_free(self, num_tokens: int) -> bool:
        """Evict unlocked cached pages until `num_tokens` slots are free; False if impossible."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available_size() >= num_tokens

    # ---- admission -------------------------------------------------------------
    @staticmethod
    def _match_key(req: Req) -> List[int]:
        """The tokens whose cached KV `req` may reuse: all but the last (which must be computed for its
        logits), or none while prompt logprobs are owed (they need the logits of every prompt position)."""
        ids = req.fill_ids
        return [] if req.needs_prompt_logprobs else ids[: len(ids) - 1]

    def match(self, req: Req) -> int:
        """Longest cached prefix of the request's fill_ids that it may reuse."""
        if not self.use_tree:
            return 0
        return self.tree.match_prefix(self._match_key(req), record_stats=False).prefix_len

    def admit(self, req: Req) -> None:
        """Give `req` a ReqToTokenPool row and its cached prefix, locked. kv_len = prefix_len."""
        req.req_pool_idx = self.req_to_token_pool.alloc()
        if self.use_tree:
            m = self.tree.match_prefix(self._match_key(req))
            self.tree.inc_lock_ref(m.last_node)
            req.last_node, req.prefix_indices, req.prefix_len = m.last_node, m.indices, m.prefix_len
            self.req_to_token_pool.write(req.req_pool_idx, 0, m.indices)
        req.kv_len = req.prefix_len

    def last_loc(self, req: Req) -> int:
        """Slot of position kv_len - 1 (-1 when the request has no KV), from the host table."""
        if req.kv_len == 0:
            return -1
        return int(self.req_to_token_pool.host[req.req_pool_idx, req.kv_len - 1])

    def _last_locs(self, reqs: List[Req]) -> List[int]:
        """last_loc of each request where the allocator needs it: only pages of more than one token
        continue a partly filled page."""
        if self.page_size == 1:
            return [-1] * len(reqs)
        return [self.last_loc(r) for r in reqs]

    def alloc_extend(self, reqs: List[Req]) -> Optional[torch.Tensor]:
        """Slots for each request's next `extend_len` positions, recorded in its row."""
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + r.extend_len for r in reqs]
        out = self.allocator.alloc_extend(prefix, seq, self._last_locs(reqs))
        if out is None:
            return None
        # One write for the whole batch (a mixed step has a request per decode row): request i's slots are
        # out[first_i : first_i + extend_len_i], for columns kv_len_i, kv_len_i + 1, ...
        # The indices are built with numpy: torch's CPU repeat_interleave splits even a few elements over
        # the intra-op thread pool, and waking that pool on a busy host costs milliseconds per step.
        lens = np.array([r.extend_len for r in reqs], dtype=np.int64)
        shift = np.array(prefix, dtype=np.int64) - (np.cumsum(lens) - lens)
        rows = np.repeat(np.array([r.req_pool_idx for r in reqs], dtype=np.int64), lens)
        cols = np.arange(out.numel(), dtype=np.int64) + np.repeat(shift, lens)
        self.req_to_token_pool.write_positions(torch.from_numpy(rows), torch.from_numpy(cols), out)
        return out

    def alloc_decode(self, reqs: List[Req]) -> Optional[torch.Tensor]:
        """One slot per request for position kv_len, recorded in its row."""
        seq_lens = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int64)
        last = torch.tensor(self._last_locs(reqs), dtype=torch.int64)
        out = self.allocator.alloc_decode(seq_lens, last)
        if out is None:
            return None
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.req_to_token_pool.write_positions(rows, seq_lens - 1, out)
        return out

    # ---- caching and release ----------------------------------------------------
    def _insert(self, req: Req) -> int:
        """Hand the page-aligned computed KV of `req` to the tree; free the request's duplicates.
        Returns the aligned length now owned by the tree."""
        aligned = req.kv_len // self.page_size * self.page_size
        slots = self.req_to_token_pool.read(req.req_pool_idx, aligned)
        already = self.tree.insert(req.fill_ids[:aligned], slots)
        if already > req.prefix_len:
            self.allocator.free(slots[req.prefix_len : already])
        return aligned

    def cache_unfinished(self, req: Req) -> None:
        """After an extend: share the computed prefix through the tree and re-lock it, so that
        other requests (n > 1 siblings, shared prompts) can reuse it while this one runs."""
        if not self.use_tree or req.kv_len // self.page_size * self.page_size <= req.prefix_len:
            return
        aligned = self._insert(req)
        m = self.tree.match_prefix(req.fill_ids[:aligned], record_stats=False)
        self.tree.inc_lock_ref(m.last_node)
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.write(req.req_pool_idx, 0, m.indices)
        req.last_node, req.prefix_indices, req.prefix_len = m.last_node, m.indices, m.prefix_len

    def release(self, req: Req, cache: bool = True) -> None:
        """Give back everything `req` holds: its computed KV goes to the tree (when caching)
        or to the free list, its lock is dropped, its row is freed. Idempotent."""
        if req.req_pool_idx is None:
            return
        start = req.prefix_len
        if self.use_tree and cache:
            start = max(start, self._insert(req))
        if req.kv_len > start:
            self.allocator.free(self.req_to_token_pool.read(req.req_pool_idx, req.kv_len)[start:])
        if self.use_tree:
            self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()
