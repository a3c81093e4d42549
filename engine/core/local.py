"""ThreadCore: the EngineCore's loop as a thread of the caller's process (offline use, tests).

The core is built in the caller's thread (model load), then its loop runs on the `engine-loop` thread,
which also calls `on_outputs` with each step's outputs. Messages reach it through a SimpleQueue. Tests
may run a function inside the loop between two steps (`run_in_loop`) to look at the scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from engine.core.client import CoreClient, DeadCallback, OutputsCallback
from engine.core.core import EngineCore
from engine.core.messages import CallResult, Shutdown, StepOutputs
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _RunInLoop:
    fn: Callable[[], Any]
    future: Future


class ThreadCore(CoreClient):
    def __init__(self, core: EngineCore, on_outputs: OutputsCallback, on_dead: DeadCallback):
        super().__init__(on_outputs, on_dead)
        self.core = core
        self.info = core.info()
        self._inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def send(self, msg: Any) -> None:
        self._inbox.put(msg)

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(timeout)

    def run_in_loop(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """fn() run by the loop thread between two steps; its result (tests inspect the scheduler so)."""
        return self.post_in_loop(fn).result(timeout=timeout)

    def post_in_loop(self, fn: Callable[[], Any]) -> Future:
        """fn() to be run by the loop thread between two steps, after the messages sent before it; returns at
        once with the Future of its result."""
        self.raise_if_dead()
        fut: Future = Future()
        self._inbox.put(_RunInLoop(fn, fut))
        return fut

    def state(self) -> str:
        queued = self._inbox.qsize()
        return f"loop thread alive: {self._thread.is_alive()}; messages queued: {queued}; {super().state()}"

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(Shutdown())
            self._thread.join(timeout=30)

    # ---- the loop thread -------------------------------------------------------------------
    def _receive(self, timeout: Optional[float]) -> Optional[List[Any]]:
        try:
            first = self._inbox.get_nowait() if timeout == 0.0 else self._inbox.get(timeout=timeout)
        except queue.Empty:
            return []
        messages, msg = [], first
        while True:
            if isinstance(msg, Shutdown):
                return None
            if isinstance(msg, _RunInLoop):
                try:
                    msg.future.set_result(msg.fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    msg.future.set_exception(exc)
            else:
                messages.append(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return messages

    def _deliver(self, obj: Any) -> None:
        if isinstance(obj, StepOutputs):
            self._on_outputs(obj.outputs)
        elif isinstance(obj, CallResult):
            self._resolve_call(obj)

    def _run(self) -> None:
        error: BaseException = EngineDeadError("the engine was shut down")
        try:
            self.core.run(self._receive, self._deliver)
        except BaseException as exc:  # noqa: BLE001 - every pending caller must hear about it
            logger.exception("engine loop failed")
            error = exc
        finally:
            self._on_outputs(self.core.fail_all(error))
            self.core.close()
            self._mark_dead(error)
