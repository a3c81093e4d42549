"""WorkerStats: what a worker replica reports of itself — its engine's EngineStats and the replica's own figures.

    WorkerBase.report() ──WorkerReport(replica_id, WorkerStats, cache events)──▶ router (one per poll)
        router: kept per worker as WorkerStats; read by attribute by the routing state, the scaler
        (cluster/scaling/loop.py) and the ingress (/metrics gauges, the pools' ServingLoad)
        GET /router/stats: workers[*].engine is WorkerStats.as_dict() — the one place that flat JSON is made

Plain data (no torch, no Ray), so that the router and the ingress read it without the engine's stack and
Ray pickles it across the replica boundary as it is.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

from engine.outputs import EngineStats


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
    counters: Dict[str, float] = field(default_factory=dict)
    """The pool role's own sums by name: a prefill replica's early_prefill_* (workers/early_prefill.py), a
    decode replica's handoff_* (workers/handoff.py); empty for the unified pool."""

    def as_dict(self) -> Dict[str, float]:
        """The flat JSON of GET /router/stats workers[*].engine: every EngineStats field, then first_output_s,
        first_output_requests, gpus, tensor_parallel_size and the role's counters, each a float. capacity is
        left out (the worker's view shows it beside this)."""
        own = {
            "first_output_s": self.first_output_s,
            "first_output_requests": self.first_output_requests,
            "gpus": self.gpus,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        return {k: float(v) for k, v in {**self.engine.as_dict(), **own, **self.counters}.items()}
