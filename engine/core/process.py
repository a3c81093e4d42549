"""ProcessCore: the EngineCore in a process of its own, which owns the device and does nothing else.

    front-end process (HTTP, tokenizer, text, streams)             core process (`python -m engine.core.process`)
    Engine ──send: pickled messages──▶ PUSH ═══ ipc ═══▶ PULL ──▶ EngineCore.run: handle, step
    on_outputs ◀── drain (event loop reader) ◀── PULL ◀═══ ipc ═══ PUSH ◀── one StepOutputs per step

Why a process: the scheduler's loop must never wait for the GIL while the front end parses HTTP,
makes text or writes SSE, and the front end must never wait for a step. Messages are batched per step
(one StepOutputs for every request), so the per-token cost of the boundary is one pickle per step.
ZMQ (pyzmq) carries the frames: the transport SGLang and vLLM use between the same two processes.

Start: the front end binds both sockets (Linux: in the abstract socket namespace, so nothing is left on
disk), starts the child with the CoreSpec on its stdin, and waits for
CoreInfo (or CoreFailed) while watching that the child is alive. The child connects, builds the
EngineCore (model load), answers CoreInfo, then runs the loop. It ignores SIGINT (the front end shuts it
down with a Shutdown message) and exits when its parent is gone.

Delivery in the front end: `attach(loop)` registers the PULL socket's descriptor with an asyncio loop, so
outputs are read and dispatched on that loop's thread (no extra thread, no GIL hand-off on the token
path). Without an attached loop (sync callers), `wait` reads the socket itself. A lock keeps one reader
at a time; pyzmq sockets are not thread-safe, so sends take a lock too.

Death: a monitor thread waits for the child to exit. An unexpected exit (crash, OOM kill) fails every
pending call and, through on_dead, every open request with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional

from engine.config import EngineConfig
from engine.core.client import CoreClient, DeadCallback, OutputsCallback
from engine.core.messages import CallResult, CoreFailed, CoreInfo, Shutdown, StepOutputs
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0
"""Bound on the core's start (model load, CUDA graph capture)."""
SHUTDOWN_TIMEOUT_S = 30.0
_POLL_MS = 50


@dataclass(frozen=True)
class CoreSpec:
    """What the core process is started with (pickled on its stdin)."""

    config: EngineConfig
    parent_pid: int
    log_level: int


_ABSTRACT = sys.platform.startswith("linux")
"""Linux: ipc endpoints in the abstract socket namespace ("@name"), which leave no file behind whatever
way the processes end; elsewhere, socket files in a private temp folder."""


def _endpoint(base: str, name: str) -> str:
    return f"ipc://{base}-{name}" if base.startswith("@") else f"ipc://{os.path.join(base, name)}"


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else an EngineDeadError naming it (a foreign exception type)."""
    try:
        pickle.loads(_dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure means: send a stand-in
        return EngineDeadError(f"the engine loop stopped: {error!r}")


class ProcessCore(CoreClient):
    def __init__(
        self,
        config: EngineConfig,
        on_outputs: OutputsCallback,
        on_dead: DeadCallback,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        import zmq

        super().__init__(on_outputs, on_dead)
        self._zmq = zmq
        self._dir = None if _ABSTRACT else tempfile.mkdtemp(prefix="radixserve-core-")
        self._base = f"@radixserve-core-{os.getpid()}-{uuid.uuid4().hex}" if _ABSTRACT else self._dir
        self._ctx = zmq.Context()
        self._push = self._socket(zmq.PUSH, "in")
        self._pull = self._socket(zmq.PULL, "out")
        self._send_lock, self._recv_lock = threading.Lock(), threading.RLock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._failure: Optional[BaseException] = None
        """The error a CoreFailed message named (the child exits right after sending it)."""
        self._stopping = False
        self._closed = False
        self._proc = self._spawn(config)
        self.info = self._await_info(start_timeout_s)
        self._monitor = threading.Thread(target=self._watch, name="engine-core-monitor", daemon=True)
        self._monitor.start()

    def _socket(self, kind: int, name: str) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.SNDHWM, 0)
        sock.setsockopt(self._zmq.RCVHWM, 0)
        sock.bind(_endpoint(self._base, name))
        return sock

    def _spawn(self, config: EngineConfig) -> subprocess.Popen:
        env = dict(os.environ)
        # The child imports this package from wherever the parent did (a Ray worker's working dir too).
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.core.process", self._base], stdin=subprocess.PIPE, env=env
        )
        spec = CoreSpec(config, os.getpid(), logging.getLogger().getEffectiveLevel())
        proc.stdin.write(_dumps(spec))
        proc.stdin.close()
        return proc

    def _await_info(self, timeout_s: float) -> CoreInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._pull.poll(_POLL_MS):
                msg = pickle.loads(self._pull.recv())
                if isinstance(msg, CoreInfo):
                    return msg
                if isinstance(msg, CoreFailed):
                    self._close(kill=True)
                    raise msg.error
            if self._proc.poll() is not None:
                self._close(kill=True)
                raise EngineDeadError(
                    f"the engine core process exited with code {self._proc.returncode} "
                    "before it was ready (its log is above)"
                )
        self._close(kill=True)
        raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")

    # ---- sending ---------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        self.raise_if_dead()
        frame = _dumps(msg)
        with self._send_lock:
            if not self._stopping:
                self._push.send(frame, copy=False)

    # ---- receiving -------------------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop or self.dead is not None:
            return
        if self._loop is not None and not self._loop.is_closed():
            return  # the first loop keeps reading; other loops get their outputs from it
        self._loop, self._loop_thread = loop, threading.get_ident()
        loop.add_reader(self._pull.getsockopt(self._zmq.FD), self._drain)
        loop.call_soon(self._drain)  # messages that arrived before: the descriptor is edge-triggered

    def _drain(self) -> None:
        """Read and dispatch every waiting message (a no-op when another reader holds the socket)."""
        if not self._recv_lock.acquire(blocking=False):
            return
        try:
            self._read_all()
        finally:
            self._recv_lock.release()

    def _read_all(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed
                return
            self._handle(pickle.loads(frame.buffer))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self._on_outputs(msg.outputs)
        elif isinstance(msg, CallResult):
            self._resolve_call(msg)
        elif isinstance(msg, CoreFailed):
            self._failure = msg.error

    def _reader_elsewhere(self) -> bool:
        """True when an attached event loop on another thread reads the socket."""
        loop = self._loop
        return (
            loop is not None
            and not loop.is_closed()
            and loop.is_running()
            and self._loop_thread != threading.get_ident()
        )

    def wait(self, event: threading.Event, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.dead is not None:
                break
            if self._reader_elsewhere():
                event.wait(min(remaining, 0.1))
                continue
            if self._recv_lock.acquire(timeout=min(remaining, 0.1)):
                try:
                    if self._closed:
                        break
                    if self._pull.poll(min(_POLL_MS, max(1, int(remaining * 1000)))):
                        self._read_all()
                finally:
                    self._recv_lock.release()
                self._kick_loop()
        return event.is_set()

    def _kick_loop(self) -> None:
        """Let the attached loop look again: a message may have come while this thread held the socket."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:
                pass

    # ---- death and shutdown ---------------------------------------------------------------
    def _watch(self) -> None:
        code = self._proc.wait()
        error = self._failure or EngineDeadError(
            "the engine was shut down" if self._stopping else f"the engine core process exited with code {code}"
        )
        if not self._stopping:
            logger.error("engine core process %d exited (code %s): %r", self._proc.pid, code, error)
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            try:
                loop.call_soon_threadsafe(self._finish, error)
                return
            except RuntimeError:
                pass
        self._finish(error)

    def _finish(self, error: BaseException) -> None:
        """The child is gone: deliver what it sent last, then fail the rest."""
        with self._recv_lock:
            self._read_all()
        self._mark_dead(self._failure or error)
        self._close(kill=False)

    def shutdown(self) -> None:
        if self._stopping:
            return
        with self._send_lock:
            self._stopping = True
            try:
                self._push.send(_dumps(Shutdown()))
            except self._zmq.ZMQError:
                pass
        try:
            self._proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning(
                "engine core process %d did not stop in %.0f s: killing it", self._proc.pid, SHUTDOWN_TIMEOUT_S
            )
            self._proc.kill()
            self._proc.wait()
        self._monitor.join(timeout=5)
        if self.dead is None:  # the monitor handed the end to a loop that is not running any more
            self._finish(EngineDeadError("the engine was shut down"))

    def _close(self, kill: bool) -> None:
        if kill and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        loop = self._loop
        if (
            loop is not None
            and not loop.is_closed()
            and loop.is_running()
            and self._loop_thread != threading.get_ident()
        ):
            try:
                loop.call_soon_threadsafe(self._close_sockets)
                return
            except RuntimeError:
                pass
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._pull.getsockopt(self._zmq.FD))
        with self._send_lock:
            self._push.close(0)
        with self._recv_lock:
            self._pull.close(0)
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def state(self) -> str:
        loop = self._loop
        reader = (
            "none" if loop is None else "running" if loop.is_running() else "closed" if loop.is_closed() else "idle"
        )
        return (
            f"core process {self._proc.pid}: exit code {self._proc.poll()} (None: running); "
            f"reading loop: {reader}; stopping: {self._stopping}; {super().state()}"
        )


# ---- the core process ---------------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(argv: List[str]) -> None:
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: CoreSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(levelname)s engine-core[%(process)d] %(name)s: %(message)s"
    )
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 5000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    pull.connect(_endpoint(argv[0], "in"))
    push.connect(_endpoint(argv[0], "out"))

    def send(obj: Any) -> None:
        push.send(_dumps(obj), copy=False)

    def receive(timeout: Optional[float]) -> Optional[List[Any]]:
        if not pull.poll(-1 if timeout is None else int(timeout * 1000)):
            return []
        messages = []
        while True:
            try:
                msg = pickle.loads(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return messages
            if isinstance(msg, Shutdown):
                return None
            messages.append(msg)

    try:
        core = _build_core(spec.config)
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which raises it
        logging.getLogger(__name__).exception("the engine core failed to start")
        send(CoreFailed(_portable(exc)))
        push.close()
        return
    send(core.info())
    error: BaseException = EngineDeadError("the engine was shut down")
    try:
        core.run(receive, send)
    except BaseException as exc:  # noqa: BLE001 - every pending request must hear about it
        logging.getLogger(__name__).exception("engine loop failed")
        error = exc
    send(StepOutputs(core.fail_all(_portable(error))))
    if not isinstance(error, EngineDeadError):
        send(CoreFailed(_portable(error)))
    core.close()
    push.close()
    pull.close()


def _build_core(config: EngineConfig) -> Any:
    from engine.core.core import EngineCore
    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer

    source = resolve_model(config.model)
    tokenizer = (
        None
        if config.skip_tokenizer_init
        else load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else source)
    )
    return EngineCore(config, source, tokenizer)


if __name__ == "__main__":
    main(sys.argv[1:])
