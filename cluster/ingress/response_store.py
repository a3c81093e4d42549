"""The cluster's ResponseStore: stored /v1/responses responses live in the router deployment (one replica), so
a response created through one ingress replica can be fetched, deleted and continued through any other.

Bounds are the router's LruResponses (serving/response_store.py: least recently used first past
ClusterArgs.response_store_max_entries responses or response_store_max_bytes; 0: disabled, and then this
side makes no call at all). The store is memory only: a restarted router replica has none, and a request naming
a lost response gets a 404 (`previous_response_not_found`), as for one evicted or deleted.
"""

import asyncio
from typing import Any, Optional

from cluster.rpc import awaited, detached, unwrap
from serving.errors import APIError
from serving.response_store import ResponseStore, StoredResponse

_RPC_TIMEOUT_S = 30.0


class RouterResponseStore(ResponseStore):
    """A ResponseStore over the router deployment's handle (its store_response / stored_response /
    delete_response methods, cluster/router/router.py). `enabled`: False when the router keeps nothing."""

    def __init__(self, router: Any, enabled: bool = True):
        self.router, self.enabled = router, enabled

    async def _call(self, make_call: Any) -> Any:
        try:
            # detached: a client leaving must not cancel a write half-way (the response is complete by then)
            return await asyncio.wait_for(awaited(detached(make_call)), _RPC_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure of the router call
            raise APIError(
                503, f"the response store (router) is unavailable: {unwrap(exc)!r}", None, "store_unavailable"
            ) from None

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.enabled:
            await self._call(lambda: self.router.store_response.remote(response_id, stored))

    async def get(self, response_id: str) -> Optional[StoredResponse]:
        if not self.enabled:
            return None
        return await self._call(lambda: self.router.stored_response.remote(response_id))

    async def delete(self, response_id: str) -> bool:
        if not self.enabled:
            return False
        return await self._call(lambda: self.router.delete_response.remote(response_id))
