"""cluster: the Ray Serve application — ingress, router and worker pool — built by
`cluster.app:deployment` (`serve run cluster.app:deployment [key=value ...]`).

Data flow (unified mode) and who owns each stage:

    client ──HTTP/OpenAI──▶ Ingress (ingress.py; routes from serving/, replicas scale freely)
        │ validate, chat template, tokenize ONCE
        │ Router.route(input_ids, rid) ─────────▶ RouterDeployment (router/router.py, 1 replica)
        │      ◀── RoutingDecision(worker_id)          ClusterState + policy (router/state.py,
        │                                              policies.py, tree.py)
        │ Worker.submit, pinned to worker_id ──▶ Worker (worker.py): engine.Engine, its core in a
        │                                          process of its own (PinnedRequestRouter, pinning.py,
        │                                          obeys session_id = replica unique_id)
        │ WorkerStream ◀── Worker.outputs: ONE stream per (ingress replica, worker), one message per
        │      engine step with the new token ids of every request of that ingress there
        │ detokenize + stop strings (engine/text.py); a stop aborts the request on the worker
        │ Router.finish(worker_id) when the request ends or is cancelled
        ▼ text → JSON / SSE
    RouterDeployment control loop (every report_interval_s):
        membership ◀── membership.py (the worker replica set Serve's controller broadcasts to the
                       router's handle); dead replicas are purged from the trees
        Worker.report() ◀── queue length, KV usage, drained radix-cache events → tree replay
        PoolScaler (scaling.py) ── each pool's target size from LLM signals (waiting, KV usage,
                       TTFT / ITL from latency.py) and the operator's settings ─▶ Serve follows it
                       through a custom autoscaling policy (scaling_policy.py); drains replicas
    Admin API + dashboard (admin.py, dashboard/, models in scaling_models.py) on the ingress,
    behind the admin key ─▶ RouterDeployment.admin_* ─▶ PoolScaler

Disaggregated mode (disaggregated.py): the ingress asks Router.route_pair for a prefill and a
decode replica and reads from its stream from the decode replica, which reserves KV pages, calls the prefill
replica (pinned) to compute the prompt and write its KV pages into them through kv_transfer/
(NIXL or NCCL), then decodes. Failures before the first token are retried on a new pair.

Token streams go worker → ingress, never through the router (docs/serving-path.md). Aborts: a
client disconnect closes the backend stream; the ingress calls Worker.abort and the engine frees the
request's pages. Configuration: config.py (ClusterArgs).
"""
