"""The worker replicas: one engine.Engine each.

base.py           WorkerBase: the ingress streams (OutputChannel), aborts, reports, health
unified.py        Worker: the unified pool
prefill.py        PrefillWorker: computes prompts, writes their KV into decode replicas
early_prefill.py  StartedPrompts: prompts the ingress started before their decode replica's call
decode.py         DecodeWorker: reserves pages, has a prefill replica fill them, decodes
handoff.py        what crosses between a handoff's sender and receiver (light: the ingress imports it)
kv_endpoint.py    a replica's KV transfer backend over its engine's pool
stats.py          WorkerStats: what a replica reports (light: the router and the ingress import it)
"""
