"""The single-node HTTP server: uvicorn with a graceful drain on SIGTERM / Ctrl-C.

Shutdown order (uvicorn calls `shutdown` once its signal handler asked it to exit):
  1. the app's Lifetimes start draining: /health answers 503 and a request that still arrives
     (on an open keep-alive connection) gets 503 + Retry-After;
  2. uvicorn stops listening (the port is released) and closes idle connections;
  3. running requests finish; any still running `grace_s` after the signal is ended with a 503
     `shutting_down` error (an error event and `[DONE]` in a stream), which frees its KV pages;
  4. uvicorn's own limit (`grace_s` + a margin) only backs this up; `on_stopped` releases the
     backend, and the process exits.
A second signal exits at once (uvicorn's force exit).

Idle keep-alive connections are closed after `keep_alive_s`, which must outlast the clients' own idle
expiry (httpx and the openai SDK: 5 s; aiohttp: 15 s): a server that closes first races the client
reusing that connection, whose next request then fails with a connection reset before reaching the app.
The default matches Ray Serve's HTTP front end, so the single node and the cluster behave alike.

uvicorn picks its event loop and HTTP parser from what is installed: uvloop and httptools (uvicorn's
`standard` extra, a dependency of this project and of Ray Serve), else asyncio's loop and the pure-Python
h11 parser, which cost CPU time for every request and every streamed event on the one loop that writes
all the streams. The server logs which it runs on (`http_stack`), and warns on the fallbacks.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable, Dict, List, Optional

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
"""How long running requests may take to finish after SIGTERM."""

DEFAULT_KEEP_ALIVE_S = 90
"""Seconds an idle keep-alive connection stays open (Ray Serve's default `keep_alive_timeout_s`)."""

_UVICORN_MARGIN_S = 5.0
"""uvicorn's own drain timeout exceeds the grace by this much, so the app ends every request itself."""


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown lets the app's requests finish within `grace_s`."""

    def __init__(
        self,
        app: FastAPI,
        grace_s: float = DEFAULT_GRACE_S,
        on_stopped: Optional[Callable[[], None]] = None,
        **config,
    ):
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_s + _UVICORN_MARGIN_S, **config))
        self.app, self.grace_s, self.on_stopped = app, grace_s, on_stopped

    async def shutdown(self, sockets: Optional[List] = None) -> None:
        self.app.state.serving.lifetimes.drain(self.grace_s)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            if self.on_stopped is not None:
                self.on_stopped()


def http_stack() -> Dict[str, str]:
    """The event loop and HTTP/1.1 parser uvicorn's `auto` settings pick in this environment:
    {"loop": "uvloop" | "asyncio", "parser": "httptools" | "h11"}."""
    has = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731 - a local predicate
    return {"loop": "uvloop" if has("uvloop") else "asyncio", "parser": "httptools" if has("httptools") else "h11"}


def log_http_stack() -> Dict[str, str]:
    """Log `http_stack()` (a warning when a pure-Python fallback is in use) and return it."""
    stack = http_stack()
    if stack == {"loop": "uvloop", "parser": "httptools"}:
        logger.info("HTTP: uvicorn on uvloop, httptools parser")
    else:
        logger.warning(
            "HTTP: uvicorn on %s loop, %s parser: install uvicorn[standard] (uvloop, httptools); the fallbacks "
            "cost CPU time per streamed event",
            stack["loop"],
            stack["parser"],
        )
    return stack


def run(
    app: FastAPI,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    grace_s: float = DEFAULT_GRACE_S,
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S,
    on_stopped: Optional[Callable[[], None]] = None,
) -> None:
    """Serve `app` until SIGTERM / SIGINT, drain (see the module docstring), then call `on_stopped`
    (what the app's backend must release). uvicorn then re-raises the signal it caught, so the
    process ends the way the signal asked (exit status -SIGTERM for a parent that waits on it)."""
    log_http_stack()
    DrainingServer(
        app, grace_s, on_stopped, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive_s
    ).run()
