"""cluster: the Ray Serve application — ingress, router and worker pools — built by
`cluster.app:deployment` (`serve run cluster.app:deployment [key=value ...]`).

The folders follow the replicas; each module's code runs in one kind of replica:

    app.py, config.py   the builder and ClusterArgs (run by `serve run`, before any replica)
    ingress/            Ingress replicas: HTTP (routes of serving/), tokenize once, ClusterBackend
                        (unified) or DisaggregatedBackend, text + stop strings, admin API, dashboard
    router/             the Router replica: an approximate radix tree per worker (pure core: tree.py,
                        state.py, policies.py) and its deployment (router.py), which also runs the
                        pools' scaling loop
    scaling/            pool sizing: the loop (loop.py, in the Router replica), the decision
                        (policy.py; FollowPoolTarget runs in Serve's controller), admin models
    workers/            worker replicas: WorkerBase (base.py), the unified Worker, PrefillWorker and
                        DecodeWorker, the handoff's wire types and their KV transfer endpoint
    kv_transfer/        moving KV pages between replicas (NIXL, NCCL), used by prefill and decode
    rpc.py, pinning.py, membership.py, latency.py
                        what the roles share: Serve call helpers, pinned request routing, the
                        replica set, the RequestTiming an ingress sends the router (the ingress's
                        clocks are in ingress/latency.py, the router's windows and sums in latency.py)

Data flow (unified mode):

    client ──HTTP/OpenAI──▶ Ingress: validate, chat template, tokenize ONCE
        │ Router.route(input_ids, rid) ──▶ RoutingDecision(worker_id)
        │ Worker.submit, pinned to worker_id (PinnedRequestRouter obeys session_id = replica id)
        │ WorkerStream ◀── Worker.outputs: ONE stream per (ingress replica, worker), one message per
        │      engine step with the new token ids of every request of that ingress there
        │ detokenize + stop strings (engine/text.py); a stop aborts the request on the worker
        │ Router.finish(worker_id) when the request ends or is cancelled
        ▼ text → JSON / SSE
    Router control loop (every report_interval_s): the replica set (membership.py), Worker.report()
    (load, radix-cache events replayed into the trees), PoolScaler.step() (scaling/loop.py)

Disaggregated mode (docs/disaggregation.md): the ingress asks Router.route_pair for a prefill and a
decode replica and reads from its stream from the decode replica, which reserves KV pages, calls the
prefill replica to compute the prompt and write its KV pages into them, then decodes.

Token streams go worker → ingress, never through the router (docs/serving-path.md).
"""
