"""The messages between an Engine (front end) and its EngineCore (scheduler), in both directions.

    Engine ──AddRequest | AddRequests | AbortRequest | CompleteReceive | ReleaseSent | CoreCall | Shutdown──▶ EngineCore
    Engine ◀──CoreInfo (once, at start) | StepOutputs (one per step, every request's news) | CallResult──

Plain picklable data: the same objects travel through a queue (core in a thread of this process) or
a ZMQ socket (core in its own process). Per-token traffic is only StepOutputs: one message per
scheduler step for all requests, never one per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, FrozenSet, List, Optional, Tuple

from engine.outputs import ReqOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """A prompt with `params.n` choices (engine rids `rid`, or `rid#i` when n > 1)."""

    rid: str
    input_ids: List[int]
    """Validated: non-empty, in the vocabulary, shorter than the context and the KV pool."""
    params: SamplingParams
    seed: int
    """Choice i samples with seed + i."""
    handoff: Optional[str] = None
    """None, "receiver" (a decode replica's side of a handoff) or "sender" (a prefill replica's side);
    engine.scheduler.handoff."""


@dataclass(frozen=True)
class AddRequests:
    """Prompts that reach the scheduler together (Engine.generate's batch): all of them are queued before its
    next step (those with a grammar once it is compiled), so how they are batched does not depend on how fast
    they were sent."""

    requests: Tuple[AddRequest, ...]


@dataclass(frozen=True)
class AbortRequest:
    """Abort engine request `rid` (every choice of it when it names a group); its pages are freed."""

    rid: str


@dataclass(frozen=True)
class CompleteReceive:
    """Receiver: the prompt's KV of `rid` landed; `handoff` is the sender's SenderHandoff."""

    rid: str
    handoff: Any


@dataclass(frozen=True)
class ReleaseSent:
    """Sender: the transfer of `rid` is over; its held pages go to the radix cache."""

    rid: str


@dataclass(frozen=True)
class CoreCall:
    """Run EngineCore.<method>(*args) between steps and answer with a CallResult of the same id."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Shutdown:
    """Stop the loop; every unfinished request fails with EngineDeadError."""


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs to validate requests; sent once, when the core is ready."""

    vocab_size: int
    """Valid token ids are [0, vocab_size) (the model's logits width)."""
    context_len: int
    kv_capacity_tokens: int
    """Token slots of the KV pool: a prompt must leave room for one page beyond it."""
    page_size: int
    eos_token_ids: FrozenSet[int]
    device: str
    attention_backend: str
    cuda_graphs: bool
    pid: int
    """Process id of the core (the front end's own when it runs in a thread)."""


@dataclass
class StepOutputs:
    """Everything one step (or one inbox drain) produced, for every request that had news."""

    outputs: List[ReqOutput] = field(default_factory=list)


@dataclass(frozen=True)
class CallResult:
    call_id: int
    value: Any = None
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class CoreFailed:
    """The core could not start, or its loop died: every request is over. Sent last."""

    error: BaseException
