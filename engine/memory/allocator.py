"""TokenToKVPoolAllocator: the free list of KV pages.

Slot s lives in page s // page_size. Pages are handed out whole; a request owns
its pages exclusively until they are freed or handed to the RadixCache (whose
nodes then own them). Page 0 is reserved (padding writes), so slot indices
handed out are always >= page_size.

Bookkeeping lives on the CPU (a stack of free page ids plus a free mask that
catches double frees); the slot indices returned are CPU int64 tensors that the
caller moves to the device once per batch.

Contiguity: the stack hands out ascending page ids, and freed pages wait in a
separate list that is merged back, sorted, only when the stack runs short (as
SGLang does). So the pages of one allocation are mostly consecutive, which lets a
KV handoff move them as few long runs (one transfer region per run).
"""

from __future__ import annotations

from typing import List, Optional

import torch


class TokenToKVPoolAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._init_free_list()

    def _init_free_list(self) -> None:
        # Pop from the end: lowest page ids are handed out first.
        self._free_pages: List[int] = list(range(self.num_pages - 1, 0, -1))
        """Free page ids, descending: the next ones handed out are at the end."""
        self._released: List[int] = []
        """Pages freed since the last merge into _free_pages (any order)."""
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._is_free[0] = False

    @property
    def size(self) -> int:
        """Usable token slots (the reserved page excluded)."""
        return (self.num_pages - 1) * self.page_size

    def available_size(self) -> int:
        """Free token slots."""
        return (len(self._free_pages) + len(self._released)) * self.page_size

    def clear(self) -> None:
        self._init_free_list()

    def alloc_pages(self, n: int) -> Optional[torch.Tensor]:
        """(n,) int64 page ids, or None (nothing taken) when fewer than n are free."""
        if n > len(self._free_pages):
            if n > len(self._free_pages) + len(self._released):
                return None
            self._free_pages = sorted(self._free_pages + self._released, reverse=True)
            self._released = []
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        pages = self._free_pages[-n:]
        del self._free_pages[-n:]
        out = torch.tensor(pages[::-1], dtype=torch.int64)
        self._is_free[out] = False
        return out

    def alloc_extend(self, prefix_lens: List[int], seq_lens: List[int], last_locs: List[int]) -> Optional[torch.Tensor]:
        """Slots for positions [prefix_lens[i], seq_lens[i]) of each request, concatenated.

        A request whose prefix ends inside a page (prefix_len % page_size != 0)
        continues in that page from `last_locs[i] + 1` (its slot of position
        prefix_len - 1); the rest comes from new pages. Returns None, taking
        nothing, when the pool is short.
        """
        ps = self.page_size
        if ps == 1:  # every slot is a page of its own: the pages, in request order, are the slots
            return self.alloc_pages(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        in_page, new_pages = [], []
        for p, s in zip(prefix_lens, seq_lens):
            room = (ps - p % ps) % ps
            first = min(s - p, room)
            in_page.append(first)
            new_pages.append(-(-(s - p - first) // ps))
        pages = self.alloc_pages(sum(new_pages))
        if pages is None:
            return None
        offsets = torch.arange(ps, dtype=torch.int64)
        parts, cursor = [], 0
        for i, (p, s) in enumerate(zip(prefix_lens, seq_lens)):
            if in_page[i]:
                parts.append(torch.arange(last_locs[i] + 1, last_locs[i] + 1 + in_page[i], dtype=torch.int64))
            rest = s - p - in_page[i]
            if rest:
                mine = pages[cursor : cursor + new_pages[i]]
                parts.append((mine[:, None] * ps + offsets).flatten()[:rest])
                cursor += new_pages[i]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: torch.Tensor, last_locs: torch.Tensor) -> Optional[torch.Tensor]:
        """One slot per request for position seq_lens[i] - 1 (seq_lens: after this step).

        seq_lens, last_locs: (bs,) int64 CPU. A request whose new position starts a
        page gets a new page; the others take last_loc + 1. Returns (bs,) int64 or None.
        """
        needs_page = (seq_lens - 1) % self.page_size == 0
        pages = self.alloc_pages(int(needs_page.sum()))
        if pages is None:
            return None
        out = last_locs + 1
        out[needs_page] = pages * self.page_size
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages holding these slots. Every page named must be owned by the caller
        whole: freeing a page twice raises (it would corrupt another owner's KV)."""
        if indices.numel() == 0:
            return
        pages = torch.unique(indices.cpu() // self.page_size)
        if bool(self._is_free[pages].any()) or bool((pages == 0).any()):
            raise RuntimeError(f"double free of KV pages {pages[self._is_free[pages]].tolist()[:8]}")
        self._is_free[pages] = True
        self._released.extend(pages.tolist())
