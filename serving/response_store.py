"""Stored Responses API responses: what `previous_response_id` continues, GET /v1/responses/{id} and
GET /v1/responses/{id}/input_items return.

A `StoredResponse` is JSON-ready data only (dicts and lists), so a store can live in another process
(the cluster keeps one in its router deployment, cluster/ingress/response_store.py). `LocalResponseStore`
is the in-memory one: least recently used entries go first once it holds more than
`StoreLimits.max_entries` responses or more than `StoreLimits.max_bytes` of conversation JSON. Limits of
0 disable the store: it keeps nothing (`enabled` is False), and the routes answer `store: false`.
"""

from __future__ import annotations

import abc
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

StoredResponse = Dict[str, Any]
"""{"response": the response object as returned, "items": the conversation it answered (input items,
those of every earlier response it continued first; each with a unique `id`, serving/response_items.py)}.
The next turn's conversation is items + response["output"] + its own input items."""

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoreLimits:
    """Bounds of a response store: at most `max_entries` responses and `max_bytes` of their JSON (compact,
    UTF-8 characters). Both are integers >= 0 (ValueError otherwise); 0 in either disables the store."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"response store {name} must be an integer >= 0 (0: store disabled), got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0


STORE_DISABLED = "this server keeps no responses (its response store is disabled)"
"""Why a lookup fails when the store is disabled (said in the 404s)."""


class ResponseStore(abc.ABC):
    """Where responses created with `store: true` are kept (async: a store may be remote)."""

    enabled: bool = True
    """False: the store keeps nothing (limits of 0): put is a no-op, get and delete find nothing."""

    @abc.abstractmethod
    async def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored` under `response_id` (may evict older entries)."""

    @abc.abstractmethod
    async def get(self, response_id: str) -> Optional[StoredResponse]:
        """The stored response, or None when unknown, deleted or evicted."""

    @abc.abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Forget `response_id`; False when it was not stored."""


class LruResponses:
    """The bounded LRU map behind LocalResponseStore (and the cluster router's store); thread-safe.
    Disabled limits (0): it keeps nothing."""

    def __init__(self, limits: StoreLimits = StoreLimits()):
        self.max_entries, self.max_bytes = limits.max_entries, limits.max_bytes
        self._entries: "OrderedDict[str, Tuple[StoredResponse, int]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        size = len(json.dumps(stored, separators=(",", ":"), ensure_ascii=False))
        with self._lock:
            self._drop(response_id)
            if size > self.max_bytes or self.max_entries == 0:
                return  # larger than the whole store (or the store is disabled): not kept, a later GET is a 404
            self._entries[response_id] = (stored, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry[0]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> List[str]:
        """Stored ids, least recently used first."""
        with self._lock:
            return list(self._entries)


class LocalResponseStore(ResponseStore):
    """This process's store (the single-node server's; one per app)."""

    def __init__(self, limits: StoreLimits = StoreLimits()):
        self.lru = LruResponses(limits)
        self.enabled = limits.enabled

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self.lru.put(response_id, stored)

    async def get(self, response_id: str) -> Optional[StoredResponse]:
        return self.lru.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.lru.delete(response_id)
