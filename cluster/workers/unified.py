"""Worker: a replica of the unified pool, which prefills and decodes its requests (see workers/base.py)."""

import time
from typing import Any, List

from cluster.workers.base import WorkerBase, WorkerItem
from engine.sampling_params import SamplingParams


class Worker(WorkerBase):
    """A replica of the unified pool: prefills and decodes its requests."""

    async def submit(
        self, input_ids: List[int], params: SamplingParams, rid: str, ingress_id: str, replica_id: str
    ) -> None:
        """Start a request; its outputs go to the stream of `ingress_id`. Raises (before anything runs)
        when the request is invalid or the call reached the wrong replica."""
        self._check_replica(replica_id)
        if self._aborted_before_submit(rid):
            return
        channel = self._channel(ingress_id)
        self._served.append(rid)
        start, first, open_choices = time.perf_counter(), [True], [params.n]

        def deliver(item: Any) -> None:  # on this replica's event loop, once per output, in order
            if isinstance(item, BaseException):
                channel.rids.discard(rid)
                channel.put(WorkerItem(rid, error=item))
                return
            if first[0]:
                first[0] = False
                self._count_first_output(start)
            if item.finish_reason is not None:
                open_choices[0] -= 1
                if open_choices[0] == 0:
                    channel.rids.discard(rid)
            channel.put(WorkerItem(rid, output=item))

        channel.rids.add(rid)
        try:
            self.engine.submit(input_ids, params, deliver, rid=rid)
        except BaseException:
            channel.rids.discard(rid)
            raise
