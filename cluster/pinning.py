"""PinnedRequestRouter: Ray Serve request routing that sends each call to the replica named in
`handle.options(session_id=<replica unique_id>)`, and publishes the replica set it sees.

Where it runs: one instance per DeploymentHandle, in the caller's process (the ingress sends
generate calls, the router deployment sends report calls). The routing decision itself is made
elsewhere (cluster.router.router.RouterDeployment); this class only obeys it:

    session_id names a live replica  → [[that replica]]     (Serve waits for a free slot there)
    session_id unknown / missing      → [all candidates]     (the pinned replica died or left:
                                                              fall back rather than spin, docs/design.md)

Membership: `update_replicas` (every replica-set broadcast of the controller) and
`on_replica_actor_died` write the live unique ids into cluster.membership (process-global, per
deployment), which the router deployment reads in-process.

Pitfall handled (docs/design.md): calls made while serving one request share its
internal_request_id, so the base class can hand a replica to the wrong pending call or none at
all. `_fulfill_next_pending_request` here hands the replica to exactly the pending call that was
routed (matched by its metadata object). It overrides a private Ray 2.60 hook: re-check on upgrades.
"""

from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster import membership


class PinnedRequestRouter(RequestRouter):
    """Route to the replica whose unique_id is the request's session_id (see module docstring)."""

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # a busy pinned replica → back off, not spin
        pin = pending_request.metadata.session_id
        if pin:
            hit = [r for r in candidate_replicas if r.replica_id.unique_id == pin]
            if hit:
                return [hit]
        return [candidate_replicas]

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        membership.publish(self._deployment_id, frozenset(r.replica_id.unique_id for r in replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        membership.mark_dead(self._deployment_id, replica_id.unique_id)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        for pr in self._pending_requests_to_fulfill:
            if pr.metadata is request_metadata and not pr.future.done():
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                if self._pending_requests_by_id.get(pr.metadata.internal_request_id) is pr:
                    self._remove_pending_request_from_indices(pr)
                return
