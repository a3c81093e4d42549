"""Stored Responses API responses: what `previous_response_id` continues and GET /v1/responses/{id} returns.

A `StoredResponse` is JSON-ready data only (dicts and lists), so a store can live in another process
(the cluster keeps one in its router deployment, cluster/ingress/response_store.py). `LocalResponseStore`
is the in-memory one: least recently used entries go first once it holds more than `max_entries`
responses or more than `max_bytes` of conversation JSON.
"""

from __future__ import annotations

import abc
import json
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

StoredResponse = Dict[str, Any]
"""{"response": the response object as returned, "items": the conversation it answered (input items,
those of every earlier response it continued first)}. The next turn's conversation is
items + response["output"] + its own input items."""

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class ResponseStore(abc.ABC):
    """Where responses created with `store: true` are kept (async: a store may be remote)."""

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
    """The bounded LRU map behind LocalResponseStore (and the cluster router's store); thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be positive")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: "OrderedDict[str, Tuple[StoredResponse, int]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        size = len(json.dumps(stored, separators=(",", ":"), ensure_ascii=False))
        with self._lock:
            self._drop(response_id)
            if size > self.max_bytes:
                return  # larger than the whole store: not kept (a later GET answers 404)
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

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.lru = LruResponses(max_entries, max_bytes)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self.lru.put(response_id, stored)

    async def get(self, response_id: str) -> Optional[StoredResponse]:
        return self.lru.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.lru.delete(response_id)
