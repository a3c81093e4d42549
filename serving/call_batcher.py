"""CallBatcher: calls of one kind made for many requests of one event loop, sent in batches.

When requests arrive (or end) in a burst (a multi-turn round, a wave of chats), one call per request would
queue them behind each other where one call for many costs about as much as one for one. So at most one
call of a kind is in flight; the items that arrive meanwhile wait and go together in the next call. Alone,
an item is sent at once; under load, one call carries every item that arrived during the previous one.
Its users:

  - the cluster's ingress replicas: their routing and finish calls to the router (cluster/ingress/backend.py,
    Router.route_many / finish_many): a decision takes the router tens of microseconds, the Serve call
    that carries it far more, and the one router replica serves every ingress replica's calls in turn;
  - the servers' prompt encoder (serving/encoder.py): one call into the Rust tokenizer per batch.

    submit(item) ─▶ future ─┐   pending ──▶ send(batch) ──▶ results
                            └── resolved with its own result (e.g. a decision, or PoolFullError for this
                                prompt); a failed call fails each of its items
    submit_nowait(item)         the same, for calls nobody awaits (Router.finish_many): a failure is logged

Owned by one component; runs on its event loop only.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Awaitable, Callable, Generic, List, Optional, Tuple, TypeVar

logger = logging.getLogger(__name__)

MAX_BATCH = 256
"""Items in one call at most."""

Item = TypeVar("Item")

Send = Callable[[List[Item]], Awaitable[List[Any]]]
"""Makes one call for a batch: one result per item, in order (an exception object for an item that failed)."""


class CallBatcher(Generic[Item]):
    def __init__(self, name: str, send: Send, max_batch: int = MAX_BATCH):
        self.name = name
        self._send = send
        self.max_batch = max_batch
        self._pending: List[Tuple[Item, Optional[asyncio.Future]]] = []
        self._task: Optional[asyncio.Task] = None
        self.calls = 0
        """Calls sent so far."""
        self.items = 0
        """Items they carried."""

    def submit(self, item: Item) -> "asyncio.Future[Any]":
        """A future of `item`'s result. It is resolved whatever happens to whoever awaits it (a caller that
        gave up on a routing decision still learns it, to release it)."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue(item, future)
        return future

    def submit_nowait(self, item: Item) -> None:
        """Send `item` with the next call; nobody waits for its result."""
        self._enqueue(item, None)

    def _enqueue(self, item: Item, future: Optional[asyncio.Future]) -> None:
        self._pending.append((item, future))
        if self._task is None:
            # Outside the caller's request context: this call carries other requests' items too, and Serve
            # cancels a request's calls when the request is cancelled (see cluster.rpc.detached).
            self._task = asyncio.get_running_loop().create_task(self._drain(), context=contextvars.Context())

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                self.calls += 1
                self.items += len(batch)
                try:
                    results = await self._send([item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"{self.name}: {len(results)} results for {len(batch)} items")
                except Exception as exc:  # noqa: BLE001 - the call failed: every item of it fails alike
                    self._settle(batch, [exc] * len(batch))
                    continue
                except BaseException:  # cancelled (the replica is stopping): so are the items waiting
                    for _, future in batch + self._pending:
                        if future is not None:
                            future.cancel()
                    self._pending = []
                    raise
                self._settle(batch, results)
        finally:
            self._task = None

    def _settle(self, batch: List[Tuple[Item, Optional[asyncio.Future]]], results: List[Any]) -> None:
        for (_, future), result in zip(batch, results):
            failed = isinstance(result, BaseException)
            if future is None:
                if failed:
                    logger.warning("%s: a call nobody awaits failed: %r", self.name, result)
            elif not future.done():
                future.set_exception(result) if failed else future.set_result(result)
