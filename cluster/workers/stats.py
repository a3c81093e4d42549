"""WorkerStats: what a worker replica reports of itself — its engine's EngineStats and the replica's own figures.

    WorkerBase.report() ──WorkerReport(replica_id, WorkerStats, cache events)──▶ router (one per poll)
        router: kept per worker as WorkerStats; read by attribute by the routing state, the scaler
        (cluster/scaling/loop.py) and the ingress (/metrics gauges, the pools' ServingLoad)
        GET /router/stats: workers[*].engine is WorkerStats.as_dict() — the one place that flat JSON is made

The pool role's own sums ride in WorkerStats.role_counters: EarlyPrefillCounters from a prefill replica
(workers/early_prefill.py), HandoffCounters from a decode replica (workers/decode.py), None from a unified
one. In the JSON they are flat keys named `<prefix><field>` (early_prefill_started, handoff_ready_s, ...).

Plain data (no torch, no Ray), so that the router and the ingress read it without the engine's stack and
Ray pickles it across the replica boundary as it is.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, TypeVar, Union

from engine.outputs import EngineStats


_C = TypeVar("_C", bound="_Counters")


class _Counters:
    """Role counters: frozen records whose JSON keys are PREFIX + field name, in field order."""

    PREFIX: ClassVar[str]

    def plus(self: _C, **by: float) -> _C:
        """A copy with each named field increased by its amount (a name that is not a field raises TypeError)."""
        unknown = set(by) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"{type(self).__name__} has no counters {sorted(unknown)}")
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in by.items()})

    def as_dict(self) -> Dict[str, float]:
        """{PREFIX + field: value as float} in field order (the keys WorkerStats.as_dict adds)."""
        return {self.PREFIX + f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def keys(cls) -> tuple:
        """The JSON keys, in order."""
        return tuple(cls.PREFIX + f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class EarlyPrefillCounters(_Counters):
    """A prefill replica's prompts started early by the ingress (workers/early_prefill.py)."""

    PREFIX: ClassVar[str] = "early_prefill_"
    started: int = 0
    """Prompts started early."""
    claimed: int = 0
    """Of them, claimed by a decode replica's prefill call."""
    dropped: int = 0
    """Of them, dropped unclaimed (forgotten by the ingress, or expired)."""
    skipped: int = 0
    """Prompts not started because started prompts held their token limit."""
    held: int = 0
    """Started prompts neither claimed nor dropped yet (a level at report time, not a sum)."""


@dataclass(frozen=True)
class HandoffCounters(_Counters):
    """A decode replica's KV handoff sums (workers/decode.py). Per successful handoff (requests): request
    arrival → pages reserved (reserve_s); prefill call made → first token and KV here (ready_s: the critical
    path). Per returned prefill call (calls): the call (compute + transfer + call overheads), and of it the
    transport out (call made → running on the prefill replica) and back (returned there → result here).
    Overhead over a unified TTFT ≈ reserve_s + ready_s − prefill_compute_s."""

    PREFIX: ClassVar[str] = "handoff_"
    requests: int = 0
    """Successful handoffs."""
    notified: int = 0
    """Of them, those that went on when the KV's completion notice brought the handoff, before the call
    returned."""
    reserve_s: float = 0.0
    ready_s: float = 0.0
    calls: int = 0
    """Prefill calls that returned."""
    call_s: float = 0.0
    prefill_compute_s: float = 0.0
    prefill_transfer_s: float = 0.0
    call_out_s: float = 0.0
    call_back_s: float = 0.0


RoleCounters = Union[EarlyPrefillCounters, HandoffCounters]
"""What a pool role reports of its own beside the engine's stats."""


@dataclass(frozen=True)
class WorkerStats:
    """One worker replica at one report: its engine's state and counters, and the replica's own."""

    engine: EngineStats
    """engine.Engine.stats() at report time."""
    capacity: Optional[int]
    """Requests the engine admits (max_running_requests + max_queued_requests); None: unbounded."""
    gpus: float
    """GPUs Ray reserved for the replica (its tensor-parallel rank processes use them); 0: CPU."""
    tensor_parallel_size: int
    """Ranks the replica's model is split over."""
    first_output_s: float = 0.0
    """Sum over requests of submit → first output handed to the ingress's channel (the replica's share of
    the TTFT; with the client's TTFT it splits time inside the worker from ingress, router and transport)."""
    first_output_requests: int = 0
    """Requests counted in first_output_s."""
    role_counters: Optional[RoleCounters] = None
    """The pool role's own counters: a prefill replica's EarlyPrefillCounters, a decode replica's
    HandoffCounters; None for the unified pool."""

    def as_dict(self) -> Dict[str, float]:
        """The flat JSON of GET /router/stats workers[*].engine: every EngineStats field, then first_output_s,
        first_output_requests, gpus, tensor_parallel_size and the role's counters (role_counters.as_dict()), each
        a float. capacity is left out (the worker's view shows it beside this)."""
        own = {
            "first_output_s": self.first_output_s,
            "first_output_requests": self.first_output_requests,
            "gpus": self.gpus,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        role = self.role_counters.as_dict() if self.role_counters is not None else {}
        return {k: float(v) for k, v in {**self.engine.as_dict(), **own, **role}.items()}
