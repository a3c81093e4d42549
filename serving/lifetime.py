"""How long a request may live: its deadline, and the server's drain on shutdown.

    Lifetimes (one per app) ──begin(timeout)──▶ Lifetime (one per HTTP request)
        every wait of the request's GenerationStream (first output, each later output) runs
        under `Lifetime.bounded`; when the deadline passes the wait raises an APIError, the stream
        is closed and the request aborted (its KV pages freed), and the client gets an error
        (a 504 before any byte is sent, an error event and `[DONE]` in a stream).
    Lifetimes.drain(grace_s): new requests get 503 + Retry-After; every running request's deadline
        becomes at most now + grace_s, when it is ended with a 503 `shutting_down` error; `idle()`
        resolves once no request is left.

A deadline is the earlier of the request's `timeout` and the server's default; None = no limit. It
costs one timer per request; a wait costs two attribute writes (the hot path runs once per token).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Optional, Set, TypeVar

from serving.errors import RETRY_AFTER_S, APIError

T = TypeVar("T")


class Lifetime:
    """One request's deadline (event-loop time; None = unbounded). Owned by its GenerationStream.

    One timer per request, not one per wait: at the deadline it cancels the wait in progress (the
    task suspended in `bounded`), or the next `bounded` call raises at once."""

    def __init__(self, owner: "Lifetimes", deadline: Optional[float], timeout_s: Optional[float]):
        self._owner, self.deadline, self._timeout_s = owner, deadline, timeout_s
        self._cut: Optional[APIError] = None
        """The error of a drain that moved the deadline (None: the deadline is the request's own)."""
        self._expired = False
        self._waiter: Optional[asyncio.Task] = None
        """The task suspended in `bounded` (what the timer cancels)."""
        self._timer: Optional[asyncio.TimerHandle] = None
        if deadline is not None:
            self._arm()

    async def bounded(self, work: Awaitable[T]) -> T:
        """`await work`, raising the request's APIError if its deadline passes first (work is cancelled)."""
        if self._expired:
            _discard(work)
            raise self._error()
        task = asyncio.current_task()
        self._waiter = task
        try:
            return await work
        except asyncio.CancelledError:
            if self._expired and task is not None and task.uncancel() == 0:  # the timer's cancel, no other
                raise self._error() from None
            raise
        finally:
            self._waiter = None

    def cut_at(self, when: float, error: APIError) -> None:
        """Move the deadline to `when` if that is earlier; the request then ends with `error`."""
        if not self._expired and (self.deadline is None or when < self.deadline):
            self.deadline, self._cut = when, error
            self._arm()

    def end(self) -> None:
        """The request is over (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._owner._ended(self)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(self.deadline, self._expire)

    def _expire(self) -> None:
        self._timer, self._expired = None, True
        if self._waiter is not None:
            self._waiter.cancel()

    def _error(self) -> APIError:
        if self._cut is not None:
            return self._cut
        return APIError(
            504, f"the request exceeded its deadline of {self._timeout_s:g} s", "timeout", "deadline_exceeded"
        )


def _discard(work: Awaitable) -> None:
    """Drop an awaitable that will not be awaited (no 'never awaited' warning, no orphan task)."""
    if asyncio.iscoroutine(work):
        work.close()
    elif isinstance(work, asyncio.Future):
        work.cancel()


class Lifetimes:
    """The app's requests in flight, their default deadline and the drain state."""

    def __init__(self, default_timeout_s: Optional[float] = None):
        if default_timeout_s is not None and default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0 or None, got {default_timeout_s}")
        self.default_timeout_s = default_timeout_s
        self.draining = False
        self._grace_end: Optional[float] = None
        self._active: Set[Lifetime] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self, timeout_s: Optional[float]) -> Lifetime:
        """A new request's Lifetime; 503 + Retry-After while draining."""
        if self.draining:
            raise shutting_down()
        limits = [t for t in (timeout_s, self.default_timeout_s) if t is not None]
        timeout = min(limits) if limits else None
        loop = asyncio.get_running_loop()
        life = Lifetime(self, None if timeout is None else loop.time() + timeout, timeout)
        self._active.add(life)
        self._idle.clear()
        return life

    def drain(self, grace_s: float) -> None:
        """Stop admitting; requests still running after `grace_s` are ended with a 503."""
        end = asyncio.get_running_loop().time() + grace_s
        self.draining = True
        self._grace_end = end if self._grace_end is None else min(self._grace_end, end)
        for life in list(self._active):
            life.cut_at(self._grace_end, shutting_down())

    async def idle(self) -> None:
        """Resolves once no request is in flight."""
        await self._idle.wait()

    @property
    def active(self) -> int:
        return len(self._active)

    def _ended(self, life: Lifetime) -> None:
        self._active.discard(life)
        if not self._active:
            self._idle.set()


def shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down; retry on another replica", None, "shutting_down", retry_after=RETRY_AFTER_S
    )
