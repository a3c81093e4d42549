"""Typed errors raised by the engine. Every one carries a clear message.

`InvalidRequestError` (and subclasses) concern one request: the engine rejects
it and keeps serving everyone else. The others concern the engine as a whole.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidConfigError(EngineError, ValueError):
    """An engine option is out of range or unknown."""


class InvalidRequestError(EngineError, ValueError):
    """A request's arguments are invalid (bad sampling parameter, empty prompt, ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class QueueFullError(EngineError):
    """The engine holds max_running_requests + max_queued_requests requests already; retry later."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model path does not exist, or the default model's package is missing."""


class UnsupportedModelError(EngineError, ValueError):
    """The model's architecture or weight format is not supported."""


class OutOfMemoryError(EngineError, MemoryError):
    """The model or the KV pool does not fit the device."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop stopped (shutdown or a fatal error)."""


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died or a collective between the ranks failed: the engine stops."""


def as_dead_error(exc: BaseException) -> EngineDeadError:
    """What callers see of `exc`, the error that stopped the engine loop: an EngineDeadError (such as
    TensorParallelError) as it is, anything else wrapped in one. Every path that reports the engine's death
    (requests, pending calls, a new call) uses this, so they all raise the same type."""
    return exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine loop stopped: {exc!r}")


class EngineAbortedError(EngineError, RuntimeError):
    """The request was aborted (by the caller or the engine) before it produced its result."""
