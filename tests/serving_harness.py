"""Serving test helpers: run an app with uvicorn in a background thread on a free localhost port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

MODEL = "smollm2-test"


@contextlib.contextmanager
def serve(app):
    """Yield the base URL (http://127.0.0.1:PORT) of `app` served by uvicorn in a thread."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_idle(engine, timeout: float = 20.0) -> dict:
    """Poll engine.stats() until nothing runs or waits; return the last stats."""
    deadline = time.time() + timeout
    while True:
        s = engine.stats()
        if (s["running"] == 0 and s["waiting"] == 0) or time.time() > deadline:
            return s
        time.sleep(0.05)
