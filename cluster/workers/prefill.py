"""PrefillWorker: a replica of the prefill pool. It computes prompts and writes their KV into decode replicas'
pools: the handoff's sender (docs/disaggregation.md); prompts the ingress started early wait here until claimed
(workers/early_prefill.py)."""

import time
from typing import Any, Dict, List, Optional

from cluster.workers.base import WorkerBase, WrongReplicaError
from cluster.workers.early_prefill import StartedPrompts
from cluster.workers.handoff import PrefillResult, TransferTarget
from cluster.workers.kv_endpoint import KVEndpoint, handoff_message
from cluster.workers.stats import EarlyPrefillCounters
from engine.sampling_params import SamplingParams


class PrefillWorker(KVEndpoint, WorkerBase):
    """A replica of the prefill pool: computes prompts and writes their KV into decode replicas."""

    async def __init__(
        self, model: Optional[str], engine_options: Dict[str, Any], kv_transfer: str, transfer_timeout_s: float
    ):
        WorkerBase.__init__(self, model, engine_options)
        self._init_transfer("prefill", kv_transfer, transfer_timeout_s)
        self.started = StartedPrompts(self.engine, self.kv_slots // 2, transfer_timeout_s)
        """Prompts the ingress started here (early_prefill), at most half the KV pool's tokens."""

    def _role_counters(self) -> EarlyPrefillCounters:
        return self.started.stats()

    async def start_prefill(
        self, input_ids: List[int], params: SamplingParams, rid: str, key: str, replica_id: str
    ) -> None:
        """Start computing a prompt that a decode replica's prefill call will claim under `key` (returns at
        once; see cluster.workers.early_prefill). Ignored when meant for another replica."""
        if replica_id == self.replica_id:
            self.started.start(input_ids, params, key)

    async def forget_prefill(self, key: str) -> None:
        """The request of `key` ended without its prompt being claimed: drop it (no-op once claimed)."""
        self.started.forget(key)

    async def prefill(
        self, input_ids: List[int], params: SamplingParams, rid: str, target: TransferTarget
    ) -> PrefillResult:
        """Compute the prompt (or claim the one the ingress started under target.early_key), write the KV of
        [target.prefix_len, prompt_len) into target.dst_pages, and return a PrefillResult with the engine's
        SenderHandoff (first token and logprobs). The hold on this replica's pages is released whatever
        happens."""
        if target.replica_id != self.replica_id:
            raise WrongReplicaError(
                f"prefill for {rid} was meant for replica {target.replica_id}, reached {self.replica_id}"
            )
        entered_at = time.time()
        self._served.append(rid)
        self.transfer.connect(target.peer)
        start = time.perf_counter()
        started = self.started.claim(target.early_key, input_ids, params) if target.early_key else None
        if started is not None:
            engine_rid = started.engine_rid
            handoff = await started.task  # cancelling this call cancels the task: the engine aborts it
        else:
            engine_rid = f"{target.early_key}~" if target.early_key else rid  # never an unclaimed one's rid
            handoff = await self.engine.prefill_for_handoff(input_ids, params, rid=engine_rid)
        computed = time.perf_counter()
        try:
            src = handoff.pages_from(target.prefix_len)
            # src_ready: the first token is on the host, so the kernels that wrote these pages are done (a CUDA
            # event on this thread's stream would also wait for whatever the engine queued since).
            handle = self.transfer.write(
                target.peer.name,
                src,
                target.dst_pages,
                target.transfer_id,
                message=handoff_message(handoff),
                src_ready=True,
            )
            await self.transfer.wait(handle, self.transfer_timeout_s)
        finally:
            self.engine.release_handoff(engine_rid)
        return PrefillResult(handoff, computed - start, time.perf_counter() - computed, entered_at, time.time())
