"""Membership: the live replica ids of each deployment, as this process's handles hear them.

Written by cluster.pinning.PinnedRequestRouter (update_replicas, on_replica_actor_died) and by
callers that saw a replica die; read by the router deployment (`members`). Kept apart from
pinning.py because Serve pickles the request router's module by value: state there would be
copied, not shared; this module is imported by reference.
"""

import threading
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional


@dataclass
class Membership:
    """Live replica unique ids of one deployment, as this process's handles last heard."""

    ids: FrozenSet[str] = frozenset()
    version: int = 0
    """Bumped on every change; readers compare it to skip work."""
    dead: set = field(default_factory=set)
    """Ids reported dead by a failed call, until the controller drops them too."""


_LOCK = threading.Lock()
_MEMBERS: Dict[str, Membership] = {}


def _key(deployment_id) -> str:
    return f"{deployment_id.app_name}#{deployment_id.name}"


def members(deployment_id) -> Membership:
    """The current Membership of `deployment_id` (a DeploymentID) in this process."""
    with _LOCK:
        return _MEMBERS.setdefault(_key(deployment_id), Membership())


def mark_dead(deployment_id, unique_id: str) -> None:
    """Exclude a replica that failed with ActorDiedError until the controller drops it too."""
    publish(deployment_id, died=unique_id)


def publish(deployment_id, ids: Optional[FrozenSet[str]] = None, died: Optional[str] = None) -> None:
    """Replace the live set (`ids`) and/or add one id to `dead`."""
    with _LOCK:
        m = _MEMBERS.setdefault(_key(deployment_id), Membership())
        new_ids = m.ids if ids is None else ids
        dead = (m.dead | ({died} if died else set())) & set(new_ids)
        if new_ids != m.ids or dead != m.dead:
            _MEMBERS[_key(deployment_id)] = Membership(frozenset(new_ids), m.version + 1, dead)
