"""Serving test helpers: run an app with uvicorn in a background thread on a free localhost port, or
`python -m serving` as a user starts it (a process of its own)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator, Optional, Tuple

MODEL = "smollm2-test"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app):
    """Yield the base URL (http://127.0.0.1:PORT) of `app` served by uvicorn in a thread."""
    import uvicorn

    port = free_port()
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
        if (s.running == 0 and s.waiting == 0) or time.time() > deadline:
            return s
        time.sleep(0.05)


_AS_AT_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'serving'; runpy.run_module('serving', run_name='__main__', alter_sys=True)"
)
"""`python -m serving` with Ctrl-C (SIGINT) handled as at a terminal: a test run started in the background
(`cmd &`) ignores SIGINT, and its children would inherit that."""


@contextlib.contextmanager
def python_m_serving(*args: str, log_path: Optional[str] = None) -> Iterator[Tuple[subprocess.Popen, str]]:
    """`python -m serving --port PORT *args` (run as _AS_AT_A_TERMINAL) on a free port, from the repository
    root; yields (process, base URL) once /health answers 200 (the process must stay alive meanwhile: its
    log's tail otherwise). Output goes to `log_path` (else this process's). Killed at the end if still
    running."""
    import httpx

    port = free_port()
    log = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(
        [sys.executable, "-c", _AS_AT_A_TERMINAL, "--port", str(port), *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT if log else None,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                tail = open(log_path).read()[-3000:] if log_path else ""
                raise AssertionError(f"python -m serving exited with {proc.returncode}\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "python -m serving did not come up"
            time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if log is not None:
            log.close()
