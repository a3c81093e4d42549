"""Prometheus metrics of one app, in the app's own CollectorRegistry (so several apps in one
process, as in tests, never collide).

Request-level series are recorded as responses go out (status by route) and as tokens stream
(TTFT, inter-token latency, end-to-end latency, token counters, see `RequestTimer`). Engine
gauges (running, waiting, KV usage and its free / evictable / total tokens, cache hit rate) are read from
`backend.stats()` at scrape.
"""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.backend import ServingLoad

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        label = {"model_name": model_name}
        r = self.registry
        self.requests = Counter(
            "radixserve_requests", "HTTP requests by route and status code.", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "radixserve_prompt_tokens", "Prompt tokens processed.", ["model_name"], registry=r
        ).labels(**label)
        self.cached_tokens = Counter(
            "radixserve_cached_prompt_tokens", "Prompt tokens served from the cache.", ["model_name"], registry=r
        ).labels(**label)
        self.generation_tokens = Counter(
            "radixserve_generation_tokens", "Tokens generated.", ["model_name"], registry=r
        ).labels(**label)
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**label)
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between streamed outputs.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**label)
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**label)
        self.running = Gauge(
            "radixserve_num_requests_running", "Requests in the running batch.", ["model_name"], registry=r
        ).labels(**label)
        self.waiting = Gauge(
            "radixserve_num_requests_waiting", "Requests in the waiting queue.", ["model_name"], registry=r
        ).labels(**label)
        self.kv_usage = Gauge(
            "radixserve_kv_cache_usage_ratio", "KV pool share held by requests.", ["model_name"], registry=r
        ).labels(**label)
        self.hit_rate = Gauge(
            "radixserve_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens.", ["model_name"], registry=r
        ).labels(**label)
        kv_tokens = {
            "total": "KV pool slots (tokens).",
            "free": "KV slots on the free list.",
            "evictable": "KV slots held only by the prefix cache, reclaimable (free + evictable = total when idle).",
        }
        self.kv_tokens = {
            kind: Gauge(f"radixserve_kv_cache_{kind}_tokens", doc, ["model_name"], registry=r).labels(**label)
            for kind, doc in kv_tokens.items()
        }

    def update_engine_gauges(self, load: ServingLoad) -> None:
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.kv_usage.set(load.kv_usage)
        self.hit_rate.set(load.cache_hit_rate)
        self.kv_tokens["total"].set(load.kv_total_tokens)
        self.kv_tokens["free"].set(load.kv_free_tokens)
        self.kv_tokens["evictable"].set(load.kv_evictable_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Latency and token bookkeeping of one request; `on_output` per StreamOutput, `finish` once."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: Optional[float] = None
        self.prompt_seen: set = set()
        self.done = False

    def on_output(self, out, prompt_key: int = 0) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.finish_reason is not None and prompt_key not in self.prompt_seen:
            # Count each prompt once, not once per choice.
            self.prompt_seen.add(prompt_key)
            self.metrics.prompt_tokens.inc(out.prompt_tokens)
            self.metrics.cached_tokens.inc(out.cached_tokens)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.metrics.e2e.observe(time.perf_counter() - self.start)
