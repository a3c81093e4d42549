"""Helpers for calls between Serve replicas, shared by every role.

awaited(call)    a DeploymentResponse as a coroutine (so that it can run as a task)
detached(fn)     fn() outside the current request's context (docs/design.md: Serve cancels a cancelled
                 request's child calls; long-lived streams and clean-up calls must not be among them)
unwrap(exc)      the exception raised inside the replica, with its own type
is_dead(exc)     the called replica is gone, or its engine is
"""

import contextvars
from typing import Any, Callable

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from engine.errors import EngineDeadError

STREAM_OPTIONS = {"stream": True, "_by_reference": False}
"""Handle options of the batched streams from workers: each message goes over Serve's gRPC transport
instead of through the object store (about twice the messages per second)."""


async def awaited(call: Any) -> Any:
    """The result of a DeploymentResponse, as a coroutine (so that it can run as a task)."""
    return await call


def detached(fn: Callable[[], Any]) -> Any:
    """fn() run outside the current request's context. Serve cancels the calls an ingress request has in
    flight when that request is cancelled (a client disconnect); a stream that serves many requests, and
    the calls that clean up after one (abort, finish), must not be among them."""
    return contextvars.Context().run(fn)


def unwrap(exc: BaseException) -> BaseException:
    """The exception raised inside a replica (engine errors keep their type and message)."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def is_dead(exc: BaseException) -> bool:
    """The called replica is gone: its actor died or cannot be reached, or its engine died (the scheduler's
    core process or a tensor-parallel rank exited: the replica then fails its health check and Serve
    replaces it). Its requests go on elsewhere, and the router drops it."""
    return isinstance(exc, (ActorDiedError, ActorUnavailableError, EngineDeadError))
