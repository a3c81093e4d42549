"""WorkerGauges: the per-worker Prometheus gauges an ingress replica exports beside serving's own metrics."""

from prometheus_client.core import GaugeMetricFamily

from cluster.ingress.backend import ClusterBackend


class WorkerGauges:
    """Prometheus collector: per-worker gauges from the backend's last ClusterStats (refreshed at
    each /metrics scrape before rendering), labelled by pool and replica."""

    _GAUGES = (  # (EngineStats field, metric, help)
        ("running", "radixserve_worker_num_requests_running", "Requests in the worker's running batch."),
        ("waiting", "radixserve_worker_num_requests_waiting", "Requests in the worker's waiting queue."),
        ("kv_usage", "radixserve_worker_kv_cache_usage_ratio", "Worker KV pool share held by requests."),
        ("cache_hit_rate", "radixserve_worker_prefix_cache_hit_rate", "Worker cached / prompt tokens."),
        ("prompt_tokens", "radixserve_worker_prompt_tokens", "Prompt tokens the worker processed."),
        ("cached_tokens", "radixserve_worker_cached_prompt_tokens", "Prompt tokens served from its cache."),
        ("generated_tokens", "radixserve_worker_generation_tokens", "Tokens the worker generated."),
    )
    _ROUTER = (  # (WorkerView field, metric, help)
        ("routed_requests", "radixserve_router_routed_requests", "Requests the router sent to the worker."),
        ("matched_tokens", "radixserve_router_matched_tokens", "Prompt tokens the router's tree held."),
        ("tree_tokens", "radixserve_router_tree_tokens", "Tokens in the router's tree of the worker."),
        ("in_flight", "radixserve_router_in_flight_requests", "Requests routed and not finished."),
    )

    def __init__(self, backend: ClusterBackend, model_name: str):
        self.backend, self.model_name = backend, model_name

    def describe(self):
        return []

    def collect(self):
        s = self.backend.last_stats
        labels = ["model_name", "pool", "replica"]
        families = []
        for key, name, doc in self._GAUGES + self._ROUTER:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for wid, w in s.workers.items() if s is not None else ():
                if (key, name, doc) in self._ROUTER:
                    value = getattr(w, key)
                else:  # a field of the worker's last EngineStats; 0 before its first report
                    value = getattr(w.reported.engine, key) if w.reported is not None else 0.0
                g.add_metric([self.model_name, w.pool, wid], float(value))
            families.append(g)
        lat = GaugeMetricFamily(
            "radixserve_router_decision_latency_ms", "Routing decision time in the router.", labels=["quantile"]
        )
        for q in ("p50", "p99"):
            lat.add_metric([q], float(s.route_latency_ms.get(q, 0.0)) if s is not None else 0.0)
        families.append(lat)
        return families
