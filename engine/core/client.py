"""CoreClient: how an Engine front end reaches its EngineCore, wherever the core runs.

Two implementations: ThreadCore (engine.core.local: the core's loop is a thread of this process —
offline use, tests) and ProcessCore (engine.core.process: the core is a process of its own that
owns the device — servers). The front end never sees which.

Contract:
- `send(msg)` queues a message for the core (any thread; never blocks on the core).
- Outputs come back through the `on_outputs(List[ReqOutput])` callback given at construction, one call
  per core step. Where it runs: the core's thread (ThreadCore); the event loop the client is attached
  to, or a thread waiting in `wait` (ProcessCore). It must not block.
- `wait(event, timeout)` blocks until `event` is set, driving delivery if nothing else does.
- `call(method, *args)` / `await call_async(method, *args)` run EngineCore.call_<method> between two
  steps and return its result (or raise its error).
- `dead` is set once the core is gone; `on_dead(error)` is then called once (any thread), after the
  outputs the core sent last: the front end fails whatever is still open.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional

from engine.core.messages import CallResult, CoreCall, CoreInfo
from engine.errors import as_dead_error
from engine.outputs import ReqOutput

OutputsCallback = Callable[[List[ReqOutput]], None]
DeadCallback = Callable[[BaseException], None]

CALL_TIMEOUT_S = 60.0


class CoreClient(abc.ABC):
    info: CoreInfo

    def __init__(self, on_outputs: OutputsCallback, on_dead: DeadCallback):
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._call_ids = itertools.count()
        self._calls: Dict[int, Future] = {}
        self.dead: Optional[BaseException] = None

    @abc.abstractmethod
    def send(self, msg: Any) -> None:
        """Queue `msg` for the core."""

    @abc.abstractmethod
    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Block until `event` is set or `timeout` s passed; returns event.is_set()."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the core (idempotent); unfinished requests end with EngineDeadError."""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs on `loop` from now on (ProcessCore); a no-op where the core delivers itself."""

    def state(self) -> str:
        """One line on where the core and this client stand, for the log of a call that got no answer."""
        return f"dead: {self.dead!r}; calls waiting: {len(self._calls)}"

    # ---- calls ---------------------------------------------------------------------------
    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        fut = self._start_call(method, args)
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        if not self.wait(done, timeout):
            raise TimeoutError(f"the engine did not answer {method}() within {timeout:.0f} s")
        return fut.result()

    async def call_async(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.attach(asyncio.get_running_loop())
        return await asyncio.wait_for(asyncio.wrap_future(self._start_call(method, args)), timeout)

    def _start_call(self, method: str, args: tuple) -> Future:
        self.raise_if_dead()
        call_id = next(self._call_ids)
        fut: Future = Future()
        self._calls[call_id] = fut
        self.send(CoreCall(call_id, method, args))
        return fut

    def _resolve_call(self, result: CallResult) -> None:
        fut = self._calls.pop(result.call_id, None)
        if fut is None or fut.done():
            return
        if result.error is not None:
            fut.set_exception(result.error)
        else:
            fut.set_result(result.value)

    # ---- death ---------------------------------------------------------------------------
    def raise_if_dead(self) -> None:
        """Raise what killed the core: an EngineDeadError (e.g. TensorParallelError) as it is, anything else
        wrapped in one, so a caller sees the same error whether it or its requests noticed first."""
        if self.dead is not None:
            err = as_dead_error(self.dead)
            raise err from (None if err is self.dead else self.dead)

    def _mark_dead(self, exc: BaseException) -> None:
        """The core is gone: fail pending calls, then tell the front end (once)."""
        if self.dead is not None:
            return
        self.dead = exc
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(as_dead_error(exc))
        self._calls.clear()
        self._on_dead(exc)
