"""ServingBackend: what the HTTP routes need from whatever runs the model.

The routes validate, apply the chat template and tokenize once; a backend only ever sees token
ids. `EngineBackend` runs one in-process `engine.Engine` (the single-node server); the cluster's
ingress implements the same base with a router in front of remote workers.

Contract of `generate_stream(input_ids, params, rid)`:
- yields `engine.StreamOutput`s (per step, per choice `index` in [0, params.n); outputs of one choice
  that waited for a slow consumer may come as one) until every choice has a `finish_reason`;
- raises `engine.errors.InvalidRequestError` / `QueueFullError` before the first output when
  the request is rejected;
- when the consumer stops early (closes or cancels the iterator), the request is aborted and
  every KV page it held is freed. `abort(rid)` does the same from outside.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, List, Optional

from engine.profiling import ProfileError
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServingLoad:
    """What /metrics exports of the model behind the routes (one engine, or a cluster's workers together)."""

    running: int
    waiting: int
    kv_usage: float
    """Share of KV memory held by requests, 0..1 (a cluster: the mean over its workers)."""
    cache_hit_rate: float
    """Cached prompt tokens / prompt tokens."""
    kv_total_tokens: int
    """KV slots of the pool (a cluster: summed over its reported workers)."""
    kv_free_tokens: int
    """Slots on the free list. Idle and leaking nothing: kv_free_tokens + kv_evictable_tokens == kv_total_tokens."""
    kv_evictable_tokens: int
    """Slots held only by the radix cache (no running request), reclaimable on demand."""


class ServingBackend(abc.ABC):
    """The model behind the routes: a tokenizer, a context length, and a token-id stream."""

    tokenizer: Any
    """engine.tokenizer.Tokenizer: chat template, encode, decode, eos ids."""
    context_len: int
    """Max prompt + output tokens of one request."""

    @property
    def vocab_size(self) -> int:
        """Valid token ids are [0, vocab_size)."""
        return self.tokenizer.vocab_size

    @abc.abstractmethod
    def generate_stream(self, input_ids: List[int], params: SamplingParams, rid: str) -> AsyncIterator[Any]:
        """An async iterator of StreamOutput (see the module docstring for the contract)."""

    async def start_profile(self, num_steps: Optional[int]) -> str:
        """Start a profiler trace of what runs the model; returns the trace's path (engine.profiling.ProfileError
        when this backend cannot)."""
        raise ProfileError("profiling is not supported by this server")

    async def stop_profile(self) -> str:
        """Stop the trace and write it; returns its path."""
        raise ProfileError("profiling is not supported by this server")

    def admission_limit(self) -> Optional[int]:
        """Most generation requests one app over this backend may hold at once, or None (no limit known; the
        backend refuses from its own queue). serving.admission.AdmissionGate refuses requests beyond it before
        reading them; it must never be below what the backend admits."""
        return None

    @abc.abstractmethod
    def abort(self, rid: str) -> None:
        """Abort every choice of request `rid` (a no-op when it already finished)."""

    @abc.abstractmethod
    async def stats(self) -> ServingLoad:
        """The current load (what /metrics exports)."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True while requests can be served."""


class EngineBackend(ServingBackend):
    """One engine.Engine (its front end in this process; its core in a thread or a process of its own)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.context_len = engine.context_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def admission_limit(self) -> Optional[int]:
        """What the engine admits (max_running_requests + max_queued_requests; None: unbounded): the HTTP
        requests of this app are at most its requests (a request of n choices holds n places there)."""
        return self.engine.config.admission_limit

    def generate_stream(self, input_ids: List[int], params: SamplingParams, rid: str) -> AsyncIterator[Any]:
        # A server behind on its streams sends what waits for a choice as one delta (Engine.generate_stream).
        return self.engine.generate_stream(input_ids, params, rid=rid, coalesce=True)

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    async def start_profile(self, num_steps: Optional[int]) -> str:
        return await self.engine.start_profile_async(num_steps)

    async def stop_profile(self) -> str:
        return await self.engine.stop_profile_async()

    async def stats(self) -> ServingLoad:
        s = await self.engine.stats_async()
        return ServingLoad(
            s.running,
            s.waiting,
            s.kv_usage,
            s.cache_hit_rate,
            s.kv_total_tokens,
            s.kv_free_tokens,
            s.kv_evictable_tokens,
        )

    async def health(self) -> bool:
        try:
            await asyncio.wait_for(self.stats(), timeout=10)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False
        return True
