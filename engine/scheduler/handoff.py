"""Handoff: the scheduler's side of prefill/decode disaggregation (one replica plays one role).

A handoff moves a prompt's KV from the sender (the engine of a prefill replica, which computes the
prompt and holds its pages) to the receiver (the engine of a decode replica, which reserves pages,
receives the KV and decodes).

    receiver (decode replica)                               sender (prefill replica)
    ─────────────────────────                               ────────────────────────
    add_request(req)       → pending (waits for memory)
    reserve_receives()     → match own radix cache, lock it,
                             allocate [prefix_len, prompt_len)
                             → awaiting; caller gets a KVReservation ──▶ Engine.prefill_for_handoff
                                                                         computes the prompt (own radix cache)
                                                                         send(): first token sampled, KV held
                                                                         caller gets a SenderHandoff, moves
                                                                         pages src → dst (cluster.kv_transfer)
    complete_receive(rid, handoff) → first token appended, ◀─ handoff ── release_sent(rid): KV → radix cache
                             prompt cached, request joins
                             the running batch and decodes

Ownership: an awaiting receive owns the slots of positions [prefix_len, prompt_len) (kv_len is set
to prompt_len at reservation, so an abort frees exactly them, with `cache=False`: their content is
not trusted until complete_receive). A held send owns its row like a running request (its
computed prefix is shared through the tree, locked) until release_sent or an abort. Neither
kind is ever in `waiting` or `running`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from engine.memory.kv_cache_manager import KVCacheManager
from engine.outputs import ReqOutput, TokenLogprob
from engine.request import Req
from engine.scheduler.output import OutputProcessor
from engine.scheduler.prefill import reserved_decode_tokens


@dataclass(frozen=True)
class KVReservation:
    """Receiver → sender: where the prompt's KV must be written."""

    rid: str
    prompt_len: int
    prefix_len: int
    """Positions [0, prefix_len) are already cached on the receiver (a multiple of page_size)."""
    dst_pages: np.ndarray
    """(pages,) int64: the receiver's page ids of positions [prefix_len, prompt_len), in position order."""
    page_size: int
    seed: int
    """The request's sampling seed: the sender samples the first token with it."""


@dataclass(frozen=True)
class SenderHandoff:
    """Sender → receiver: the computed prompt, while the sender holds its pages."""

    rid: str
    prompt_len: int
    src_pages: np.ndarray
    """(pages,) int64: the sender's page ids of positions [0, prompt_len), in position order."""
    page_size: int
    first_token: int
    first_logprob: Optional[TokenLogprob]
    """Set when the request asked for logprobs."""
    prompt_logprobs: Optional[List[TokenLogprob]]
    """Set when the request asked for prompt logprobs."""
    cached_tokens: int
    """Prompt tokens the sender reused from its radix cache."""

    def pages_from(self, prefix_len: int) -> np.ndarray:
        """Source pages of positions [prefix_len, prompt_len) (prefix_len a multiple of page_size)."""
        return self.src_pages[prefix_len // self.page_size :]


def _page_ids(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """(pages,) int64 page ids of `slots` (consecutive positions, the first one page-aligned): numpy, the
    form the transfer layer takes and Ray pickles compactly."""
    return (slots[::page_size] // page_size).cpu().numpy().astype(np.int64, copy=False)


class HandoffState:
    def __init__(self, kv: KVCacheManager, output: OutputProcessor, counters: Dict[str, int], new_token_ratio: float):
        self.kv, self.output, self.counters, self.ratio = kv, output, counters, new_token_ratio
        self.pending: List[Req] = []
        """Receiver: waiting for destination pages."""
        self.awaiting: Dict[str, Req] = {}
        """Receiver: pages reserved, KV in flight."""
        self.held: Dict[str, Req] = {}
        """Sender: prompt computed, pages held for the transfer."""

    def reqs(self) -> List[Req]:
        return self.pending + list(self.awaiting.values()) + list(self.held.values())

    def forget(self, req: Req) -> None:
        """Drop an aborted request from every collection (the caller frees its KV)."""
        if req in self.pending:
            self.pending.remove(req)
        self.awaiting.pop(req.rid, None)
        self.held.pop(req.rid, None)

    # ---- receiver -------------------------------------------------------------------------
    def reserve_receives(self, running: List[Req]) -> bool:
        """Reserve pages for pending receives, in arrival order, while memory allows (keeping what the
        running requests are expected to still need). Returns True when one was reserved."""
        did = False
        while self.pending:
            req = self.pending[0]
            kv = self.kv
            if kv.req_to_token_pool.available_size() == 0:
                break
            prompt_len = len(req.origin_input_ids)
            budget = kv.available() - sum(reserved_decode_tokens(r, self.ratio) for r in running)
            need = kv.pages_for(req, prompt_len - kv.match(req)) * kv.page_size
            if need > budget and running:
                break
            kv.admit(req)
            req.extend_len = prompt_len - req.prefix_len
            slots = None
            if kv.ensure_free(kv.pages_for(req, req.extend_len) * kv.page_size):
                slots = kv.alloc_extend([req])  # host tensor: the reservation needs no device read-back
            if slots is None:
                kv.release(req, cache=False)
                break
            req.kv_len, req.extend_len = prompt_len, 0
            self.pending.pop(0)
            self.awaiting[req.rid] = req
            reservation = KVReservation(
                req.rid, prompt_len, req.prefix_len, _page_ids(slots, kv.page_size), kv.page_size, req.seed
            )
            req.on_output(_handoff_output(req, reservation))
            did = True
        return did

    def complete_receive(self, rid: str, handoff: SenderHandoff) -> Optional[Req]:
        """The prompt's KV has landed: append the first token. Returns the request when it goes on
        decoding (the caller adds it to the running batch); None when it finished or is unknown
        (aborted meanwhile: its pages are already free)."""
        req = self.awaiting.pop(rid, None)
        if req is None:
            return None
        self.counters["prompt_tokens"] += req.kv_len
        self.counters["cached_tokens"] += req.prefix_len
        req.cached_tokens = handoff.cached_tokens
        if handoff.prompt_logprobs is not None:
            req.prompt_logprobs = list(handoff.prompt_logprobs)
        self.output.append_sampled(req, handoff.first_token, handoff.first_logprob)
        self.counters["generated_tokens"] += 1
        if req.finished:
            self.kv.release(req, cache=True)
            self.counters["finished"] += 1
            self.output.flush([req])
            return None
        self.kv.cache_unfinished(req)
        self.output.flush([req])
        return req

    # ---- sender ---------------------------------------------------------------------------
    def send(self, req: Req, token: int, logprob: Optional[TokenLogprob]) -> None:
        """The prompt of a sender's request is computed: hold its KV and give the caller its SenderHandoff."""
        prompt_len = len(req.origin_input_ids)
        self.kv.cache_unfinished(req)  # share the prompt with later requests while the transfer runs
        self.held[req.rid] = req
        slots = self.kv.req_to_token_pool.read(req.req_pool_idx, prompt_len)
        handoff = SenderHandoff(
            req.rid,
            prompt_len,
            _page_ids(slots, self.kv.page_size),
            self.kv.page_size,
            token,
            logprob if req.sampling_params.logprobs else None,
            list(req.prompt_logprobs) if req.sampling_params.prompt_logprobs is not None else None,
            req.cached_tokens,
        )
        req.on_output(_handoff_output(req, handoff))

    def release_sent(self, rid: str) -> None:
        """The transfer is over (done or failed): the held KV goes to the radix cache."""
        req = self.held.pop(rid, None)
        if req is None:
            return
        self.kv.release(req, cache=True)
        self.counters["finished"] += 1


def _handoff_output(req: Req, handoff) -> ReqOutput:
    return ReqOutput(req.rid, [], [], None, None, len(req.origin_input_ids), req.cached_tokens, 0, handoff=handoff)
