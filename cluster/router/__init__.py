"""router: choose a worker for each tokenized request. The core (tree, state, policies) is pure
Python without Ray; router.py wraps it in the Serve deployment (import it explicitly).

Data flow and owners:

    ingress ── input_ids ──▶ PoolRouter.route (policies.py)
                               │ RoutingPolicy.choose(input_ids, ClusterState) → RoutingDecision
                               │ (a full worker, by in-flight vs its reported capacity, is not chosen;
                               │  every worker full → PoolFullError, the ingress's 503 queue_full)
                               │ ClusterState.on_routed: in-flight += 1, prompt → worker's tree
                               ▼
                             the chosen worker runs the request; on completion or abort the
                             router deployment calls PoolRouter.finish / ClusterState.on_finished
    workers ── reports ──▶ ClusterState.on_report (state.py): queue length, KV usage, and the
                             CacheEvents drained from the worker's RadixCache, replayed onto
                             its ApproximateTree (tree.py) so the approximation is corrected
    serving layer ── replica ids ──▶ ClusterState.sync_members: joiners start with empty
                             trees, leavers are purged

Owners: ApproximateTree (tree.py) — one worker's believed cache, LRU-capped;
ClusterState / WorkerState (state.py) — membership, load, per-worker counters;
RoutingPolicy and its registry (policies.py) — the decision. Nothing here is
thread-safe: the router deployment's event loop owns all of it.
"""

from cluster.router.policies import (
    Finished,
    NoWorkersError,
    PoolFullError,  # noqa: F401
    PoolRouter,
    RouteRequest,
    RoutingDecision,
    RoutingPolicy,  # noqa: F401
    available_policies,
    make_policy,
    register_policy,
)
from cluster.router.state import (
    ClusterState,
    MembershipChange,
    RouterConfig,
    WorkerState,  # noqa: F401
    RoutingStats,
)
from cluster.router.tree import ApproximateTree  # noqa: F401
