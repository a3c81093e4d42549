"""The ingress replica's clocks: one request's stream (RequestClock → the RequestTiming its finish call carries
to the router, cluster/latency.py) and this replica's own share of TTFT (IngressLatency, GET /router/stats)."""

import collections
import time
from typing import Any, Deque, Iterable, Optional

from cluster.latency import RequestTiming, percentiles


class RequestClock:
    """Ingress side: feed every message (a list of engine.StreamOutput) of one request's stream; started when
    the worker call is made, after the routing call (`route_ms`, timed by the caller)."""

    def __init__(self, route_ms: Optional[float] = None) -> None:
        self.route_ms = route_ms
        self.start = time.perf_counter()
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.messages = 0
        self.tokens = 0

    def on_chunk(self, outputs: Iterable[Any]) -> None:
        n = sum(len(getattr(o, "new_token_ids", ()) or ()) for o in outputs)
        if n == 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last, self.messages, self.tokens = now, self.messages + 1, self.tokens + n

    def timing(self) -> RequestTiming:
        ttft = None if self.first is None else (self.first - self.start) * 1e3
        itl = (self.last - self.first) * 1e3 / (self.messages - 1) if self.messages > 1 else None
        return RequestTiming(ttft, itl, self.tokens, self.route_ms)


class IngressLatency:
    """One ingress replica's own share of its requests' TTFT, per request:

        routing call (ask the router, await its decision)   → route_rpc
        worker call made → first message with tokens back    → first_message
                           (the worker's own time, Worker's first_output counters, is inside it)

    so that client TTFT − route_rpc − first_message is HTTP and the serving layer, and
    first_message − the worker's first_output is the Serve call's transport out and back.
    Kept as recent samples (percentiles) and cumulative sums (means over any interval)."""

    def __init__(self, maxlen: int = 4096):
        self.route_rpc_ms: Deque[float] = collections.deque(maxlen=maxlen)
        self.first_message_ms: Deque[float] = collections.deque(maxlen=maxlen)
        self.sums = {"route_rpc_s": 0.0, "route_rpc_calls": 0, "first_message_s": 0.0, "first_message_requests": 0}

    def on_route(self, ms: float) -> None:
        self.route_rpc_ms.append(ms)
        self.sums["route_rpc_s"] += ms / 1e3
        self.sums["route_rpc_calls"] += 1

    def on_request(self, clock: RequestClock) -> None:
        """A request's stream ended: count its call → first message time (if a token came)."""
        if clock.first is not None:
            ms = (clock.first - clock.start) * 1e3
            self.first_message_ms.append(ms)
            self.sums["first_message_s"] += ms / 1e3
            self.sums["first_message_requests"] += 1

    def snapshot(self) -> dict:
        return {
            "route_rpc_ms": percentiles(self.route_rpc_ms),
            "first_message_ms": percentiles(self.first_message_ms),
            **self.sums,
        }
