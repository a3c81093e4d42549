"""The Ingress replicas: the cluster's HTTP front.

deployment.py     Ingress: serving's OpenAI app over a backend, /router/stats, the admin API
backend.py        ClusterBackend (unified): route, submit, read the worker's batched stream, make text
disaggregated.py  DisaggregatedBackend: a prefill + decode pair per request
metrics.py        per-worker Prometheus gauges
admin.py          /admin/* and /dashboard/ (dashboard/: static HTML + JS + CSS)
haproxy_launcher.py  `radixserve-haproxy`, what Ray starts as the HAProxy in front of these replicas:
                  its stats page and exporter on 127.0.0.1, then the real HAProxy (no replica runs it)
"""
