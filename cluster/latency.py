"""TTFT and ITL per pool: measured by the ingress (cluster/ingress/latency.py), gathered by the router, read by
the scaler. This module holds the wire type (RequestTiming) and the router's side.

    ingress ClusterBackend.generate_stream: RequestClock.on_chunk per message from the worker
        └─ finish(worker_id, ..., timing=RequestClock.timing())   (rides on the finish RPC it sends anyway)
    RouterDeployment.finish ─▶ PoolScaler.observe(pool, timing) ─▶ PoolLatency of that pool:
        a window of recent samples (p90 for autoscaling, LATENCY_WINDOW_S) and cumulative
        histogram buckets (exported by the ingress /metrics as radixserve_pool_* histograms)

Source choice: the ingress is where a client's tokens arrive, so its clock is what users see,
and the router sees every ingress replica's requests (one histogram per pool for the cluster).
TTFT is measured from the routing call to the first message with tokens; ITL is the request's
mean gap between token messages ((t_last - t_first) / (messages - 1)), one sample per request.
TTFT belongs to the pool that computes prompts (unified or prefill), ITL to the pool that decodes
(unified or decode).
"""

import bisect
import collections
import time
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""Histogram upper bounds in seconds (serving/metrics.py uses the same)."""
LATENCY_WINDOW_S = 10.0
"""Samples older than this no longer count for the autoscaling p90."""


@dataclass(frozen=True)
class RequestTiming:
    """One finished request's latencies, as the ingress saw them."""

    ttft_ms: Optional[float]
    """Worker call → first message with tokens; None when no token arrived (failed or aborted before the first)."""
    itl_ms: Optional[float]
    """Mean gap between token messages; None with fewer than two."""
    output_tokens: int = 0
    route_ms: Optional[float] = None
    """The routing call that chose this attempt's worker (None: not timed)."""


@dataclass
class Histogram:
    """Cumulative Prometheus-style histogram (seconds)."""

    counts: List[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    """Per bucket (not cumulative); the last one is +Inf."""
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> List[Tuple[str, int]]:
        """[(upper bound as text, cumulative count)], ending with +Inf (prometheus_client's format)."""
        out, acc = [], 0
        for bound, c in zip([str(b) for b in BUCKETS_S] + ["+Inf"], self.counts):
            acc += c
            out.append((bound, acc))
        return out


def percentiles(samples) -> Dict[str, float]:
    """p50, p99, max and count of latency samples (ms)."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    xs = sorted(samples)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]

    return {"p50": q(0.5), "p99": q(0.99), "max": xs[-1], "count": len(xs)}


class IngressTotals:
    """The ingress's share of TTFT summed over every ingress replica, from the RequestTiming each request's
    finish call brings the router (which hears all replicas): routing calls and worker call → first message.
    Cumulative sums, so a reader takes means over any interval (two snapshots)."""

    def __init__(self) -> None:
        self.sums = {"route_rpc_s": 0.0, "route_rpc_calls": 0, "first_message_s": 0.0, "first_message_requests": 0}

    def observe(self, timing: RequestTiming) -> None:
        if timing.route_ms is not None:
            self.sums["route_rpc_s"] += timing.route_ms / 1e3
            self.sums["route_rpc_calls"] += 1
        if timing.ttft_ms is not None:
            self.sums["first_message_s"] += timing.ttft_ms / 1e3
            self.sums["first_message_requests"] += 1


class LatencyWindow:
    """Recent samples (for a p90) plus a cumulative histogram of everything observed."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, maxlen: int = 4096):
        self.window_s = window_s
        self.samples: Deque[Tuple[float, float]] = collections.deque(maxlen=maxlen)
        self.histogram = Histogram()

    def observe(self, ms: float, now: Optional[float] = None) -> None:
        self.samples.append((time.monotonic() if now is None else now, ms))
        self.histogram.observe(ms / 1e3)

    def recent(self, now: Optional[float] = None) -> List[float]:
        now = time.monotonic() if now is None else now
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        return [v for _, v in self.samples]
