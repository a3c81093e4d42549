"""What the engine hands back: per-step deltas and whole results. Plain data, no torch, so that the
front end (serving/, the cluster's ingress) can type them without importing the model stack, and so
that they pickle compactly across the process boundary between an Engine and its EngineCore.

    EngineCore step ──ReqOutput (token ids, logprobs, finish; per engine request)──▶ Engine front end
        ──StreamOutput (per step, per choice; text made by engine.text.OutputText)──▶ caller
        ──GenerateOutput (whole choice, the sync API)

    Engine.stats() ──EngineStats (state between two steps, counters since start)
    RadixCache.drain_events() ──CacheEvent (what a router replays onto its copy of the tree)
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or a completed grammar
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # aborted by the caller or the engine


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: List[tuple] = field(default_factory=list)
    """[(token_id, logprob), ...] best first."""


@dataclass
class ReqOutput:
    """What one scheduler step produced for one engine request (crosses from the core to the front end).

    Carries token ids only: the front end makes text and checks stop strings (engine.text)."""

    rid: str
    new_token_ids: List[int]
    logprobs: List[TokenLogprob]
    finish_reason: Optional[FinishReason]
    matched_stop: Any
    """The stop token id that finished the request (EOS, stop_token_ids, a grammar's end), else None."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: Optional[BaseException] = None
    """Set when the request failed (rejected, or the engine died); the request is over."""
    prompt_logprobs: Optional[List[TokenLogprob]] = None
    """Set once, on the first output of a request that asked for them."""
    handoff: Any = None
    """Disaggregation (engine.scheduler.handoff): a KVReservation (receiver) or a SenderHandoff
    (sender); such an output carries no tokens."""

    def __reduce__(self):
        # One message per step carries one of these per running request: a positional tuple pickles in
        # half the time of the default field dict and unpickles three times faster.
        return (
            ReqOutput,
            (
                self.rid,
                self.new_token_ids,
                self.logprobs,
                self.finish_reason,
                self.matched_stop,
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
                self.error,
                self.prompt_logprobs,
                self.handoff,
            ),
        )


@dataclass
class StreamOutput:
    """What one engine step added to one request (one choice when n > 1)."""

    rid: str
    index: int
    new_token_ids: List[int]
    text: str
    logprobs: Optional[List[TokenLogprob]]
    finish_reason: Optional[str]
    matched_stop: Any
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_logprobs: Optional[List[TokenLogprob]] = None
    """On the first output only, when sampling_params.prompt_logprobs is set."""

    def continues_with(self, later: Any) -> bool:
        """Whether `later` (something queued after this output) may be merged into it with `then`: an output of
        the same choice, this one not its last."""
        return self.finish_reason is None and isinstance(later, StreamOutput) and later.index == self.index

    def then(self, later: "StreamOutput") -> "StreamOutput":
        """This output followed by `later` (the next output of the same choice) as one output: the tokens,
        text and logprobs of both in order; the finish, stop and counts of `later`."""
        logprobs = (
            None
            if self.logprobs is None and later.logprobs is None
            else [*(self.logprobs or []), *(later.logprobs or [])]
        )
        return StreamOutput(
            self.rid,
            self.index,
            self.new_token_ids + later.new_token_ids,
            self.text + later.text,
            logprobs,
            later.finish_reason,
            later.matched_stop,
            later.prompt_tokens,
            later.cached_tokens,
            later.completion_tokens,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )

    def __reduce__(self):
        # A cluster worker sends one of these per request per engine step: pickled as a positional tuple.
        return (
            StreamOutput,
            (
                self.rid,
                self.index,
                self.new_token_ids,
                self.text,
                self.logprobs,
                self.finish_reason,
                self.matched_stop,
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
                self.prompt_logprobs,
            ),
        )


@dataclass
class GenerateOutput:
    """The whole result of one request (one choice when n > 1)."""

    rid: str
    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    matched_stop: Any
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: Optional[List[TokenLogprob]] = None
    prompt_logprobs: Optional[List[TokenLogprob]] = None
    """Logprobs of prompt tokens 1..n-1 (sampling_params.prompt_logprobs set), else None."""


@dataclass(frozen=True)
class EngineStats:
    """One engine's state, taken between two steps (Engine.stats), and its counters since it started.

    KV figures are in tokens (slots): kv_free_tokens + kv_evictable_tokens + what running requests hold =
    kv_total_tokens; kv_cached_tokens (the radix cache) includes the evictable tokens and those locked by
    running requests. An idle engine that leaked nothing has kv_free_tokens + kv_evictable_tokens ==
    kv_total_tokens and kv_cached_tokens == kv_evictable_tokens."""

    running: int
    """Requests in the running batch (a request being prefilled in chunks counts)."""
    waiting: int
    """Requests queued for their first step, including those still compiling a grammar or pending receives
    (disaggregation: waiting for pages to receive their KV into)."""
    handoff_in_flight: int
    """Disaggregation: requests whose KV is being handed over (awaiting it on the receiver, or held by the sender)."""
    kv_total_tokens: int
    kv_free_tokens: int
    kv_cached_tokens: int
    kv_evictable_tokens: int
    kv_usage: float
    """Share of the pool held by requests (neither free nor evictable), 0..1."""
    cache_hit_rate: float
    """cached_tokens / prompt_tokens since start (0 before the first prompt)."""
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    retractions: int
    finished: int
    aborted: int
    prefill_steps: int
    """EXTEND steps, mixed ones included."""
    decode_steps: int
    mixed_steps: int
    """EXTEND steps that also decoded running requests (counted in prefill_steps too)."""
    device_wait_s: float = 0.0
    """Seconds the scheduler's loop blocked waiting for the device's results since start: the rest of its
    time went to the host's own work (0 on the CPU, where the forward runs on the host)."""
    device_busy_s: float = 0.0
    """Seconds the device spent running the engine's steps since start, from CUDA events queued around each
    step (engine/runner/device_clock.py); it includes waits inside a step whose kernels the host queues
    more slowly than the device runs them (0 on the CPU)."""
    device_gap_decode_s: float = 0.0
    """Seconds the device sat with nothing queued before decode steps launched back to back with the step
    before: it waited for the host to plan and prepare them (0 on the CPU)."""
    device_gap_mixed_s: float = 0.0
    """The same, before mixed steps (prefill + decode rows)."""
    device_gap_prefill_s: float = 0.0
    """The same, before prefill steps without decode rows."""

    def as_dict(self) -> Dict[str, float]:
        """Every field by name (JSON bodies, Prometheus, the cluster's worker reports)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CacheEvent:
    """A change of the tree's content, for the router to replay.

    insert: the last `num_tokens` tokens of `token_ids` are now cached (the rest was already).
    evict: the last `num_tokens` tokens of `token_ids` are no longer cached; evicted nodes are
    leaves, so nothing below them was cached either.
    """

    kind: Literal["insert", "evict"]
    token_ids: Tuple[int, ...]
    """The full key path from the root to the end of the affected node."""
    num_tokens: int
