"""AdmissionGate: a request is admitted or refused as soon as it enters; the admitted ones start a few per
turn of the event loop.

A burst of N requests reaches one front end at once. Each admitted request costs the front end's event loop
its body parse, validation, chat template, tokenization and the calls that start it; requests still on their
way in (accepted, read, parsed by the HTTP server between two turns of the loop) wait behind that work. Were
the backend the only judge, the requests beyond capacity would hear "full" only after the loop had done the
work of every earlier one. The gate answers first:

- it counts the generation requests this app holds (from the moment it lets one in until its response
  ends) and refuses one at once, 503 `queue_full` with `Retry-After`, before its body is read, when that
  count has reached `ServingBackend.admission_limit()`;
- at most START_BATCH admitted requests start their work per turn of the loop; the others wait, in order,
  for the next turns. Between two turns the loop reads its sockets, so requests on their way in enter (and
  are refused) between batches instead of after the whole burst's work. The work is the same, in another
  order: a lone request, or a few together, start at once.

The count is per app (per front-end replica), a lower bound of the load behind it, so the gate never refuses
what the backend would admit; the backend's own refusal (QueueFullError, the cluster's pool check) stays the
authority for the requests the gate lets in. A backend without a limit (`admission_limit()` is None: no
bound known, as for the offline engine) is neither gated nor paced.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Deque

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.backend import ServingBackend
from serving.errors import queue_full

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/generate"})
"""POST routes that run the model (what the gate counts and may refuse)."""

START_BATCH = 2
"""Admitted requests that start their work per turn of the event loop (a start costs a few milliseconds of
the loop: parsing, tokenization, the first calls)."""


class AdmissionGate:
    """Pure ASGI middleware over the app of `backend` (see the module docstring). `held`: generation requests
    let in and not yet answered, those waiting for their turn to start included. Runs on one event loop (no
    locking)."""

    def __init__(self, app: ASGIApp, backend: ServingBackend):
        self.app, self.backend = app, backend
        self.held = 0
        self._waiting: Deque[asyncio.Future] = collections.deque()
        """Admitted requests waiting for their turn, oldest first (a cancelled one is skipped)."""
        self._turn_starts = 0
        """Requests started (or released to start) in the current turn."""
        self._turn_pending = False
        """A `_next_turn` call is scheduled."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        limit = self.backend.admission_limit()
        if limit is None:
            await self.app(scope, receive, send)
            return
        if self.held >= limit:
            refusal = queue_full(f"the server is full ({limit} requests admitted); retry later").response()
            await refusal(scope, receive, send)
            return
        self.held += 1
        try:
            loop = asyncio.get_running_loop()
            if not self._may_start_now(loop):
                turn = loop.create_future()
                self._waiting.append(turn)
                await turn
            await self.app(scope, receive, send)
        finally:
            self.held -= 1

    def _may_start_now(self, loop: asyncio.AbstractEventLoop) -> bool:
        """True (and counted) when this turn has room and nobody waits; a turn ends with `_next_turn`."""
        if not self._turn_pending:
            self._turn_pending, self._turn_starts = True, 0
            loop.call_soon(self._next_turn, loop)
        if self._waiting or self._turn_starts >= START_BATCH:
            return False
        self._turn_starts += 1
        return True

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs once per turn of the loop while requests wait: lets the next START_BATCH of them start (they run
        in the following turn, after the loop has read its sockets)."""
        self._turn_starts = 0
        while self._waiting and self._turn_starts < START_BATCH:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                self._turn_starts += 1
        if self._waiting:
            loop.call_soon(self._next_turn, loop)
        else:
            self._turn_pending = False
