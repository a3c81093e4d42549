"""RouteBatcher: an ingress replica's routing calls, sent to the router in batches.

A routing decision takes the router tens of microseconds; the Serve call that carries it costs both sides
far more (request handling, serialization, gRPC), and the router replica serves every ingress replica's
calls one at a time. When prompts arrive in a burst (a multi-turn round, a wave of chats), one call per
prompt queues them behind each other. So each ingress replica keeps at most one routing call in flight;
the prompts that arrive meanwhile wait and go together in the next call (Router.route_many). Alone, a
prompt is sent at once, as before; under load, one call carries every prompt that arrived during the
previous one.

    route(request) ─▶ future ─┐   pending ──▶ send(batch) ── Router.route_many ──▶ [decision | error]
                              └── resolved with its own result (a decision, or PoolFullError /
                                  NoWorkersError for this prompt; the call's own failure for all of them)

Owned by one ingress replica; runs on its event loop only.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Awaitable, Callable, List, Optional, Tuple

from cluster.router.policies import RouteRequest

logger = logging.getLogger(__name__)

MAX_BATCH = 256
"""Prompts in one routing call at most."""

Send = Callable[[List[RouteRequest]], Awaitable[List[Any]]]
"""Routes a batch: one result per request, in order (a RoutingDecision, or the exception for that request)."""


class RouteBatcher:
    def __init__(self, send: Send, max_batch: int = MAX_BATCH):
        self._send = send
        self.max_batch = max_batch
        self._pending: List[Tuple[RouteRequest, asyncio.Future]] = []
        self._task: Optional[asyncio.Task] = None
        self.calls = 0
        """Routing calls sent so far."""
        self.routed = 0
        """Requests they carried."""

    def route(self, request: RouteRequest) -> "asyncio.Future[Any]":
        """A future of `request`'s decision. It is resolved whatever happens to whoever awaits it (a caller
        that gave up still learns the decision, to release it)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((request, future))
        if self._task is None:
            # Outside the caller's request context: Serve cancels a request's calls when the request is
            # cancelled, and this call carries other requests too (see cluster.rpc.detached).
            self._task = loop.create_task(self._drain(), context=contextvars.Context())
        return future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                self.calls += 1
                self.routed += len(batch)
                try:
                    results = await self._send([request for request, _ in batch])
                except Exception as exc:  # noqa: BLE001 - the call failed: every request of it fails alike
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException:  # cancelled (the replica is stopping): so are the requests waiting
                    for _, future in batch + self._pending:
                        future.cancel()
                    self._pending = []
                    raise
                if len(results) != len(batch):
                    error = RuntimeError(f"the router answered {len(results)} decisions for {len(batch)} prompts")
                    results = [error] * len(batch)
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._task = None
