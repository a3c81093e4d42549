"""WorkerBase: what every pool's replica has — one engine.Engine, streaming to each ingress in batches.

    ingress ──outputs(ingress_id, replica_id), streamed, pinned──▶ Worker.outputs: ONE long-lived stream
        ◀── List[WorkerItem] per message: every request of that ingress here, everything the engine
            produced since the last message (token ids, logprobs, finish; no text: the ingress
            detokenizes and checks stop strings, and aborts a choice it stopped with abort(rid))
    ingress ──submit(input_ids, params, rid, ingress_id, replica_id), pinned──▶ starts a request
    ingress ──abort(rid)──▶ the request (or choice "<rid>#<i>") is aborted, its pages freed
    router  ──report() every report_interval_s, pinned──▶ WorkerReport (WorkerStats + drained cache events)

Batching: the engine core sends one message per step for all its requests; the engine front end
hands each request's outputs to the channel of the ingress that submitted it (OutputChannel), and
the ingress's stream takes everything queued as one message. So Ray Serve carries one message per
engine step per ingress replica, not one per request (nor per token).

Where the engine runs: the engine's core (scheduler, model, KV) is a process of its own
(EngineConfig.core_process, on in the cluster), so this replica's event loop — Serve's RPCs, the
channels — never delays a step.

Failures: an ingress whose stream ends (it went away) has its requests here aborted. A request
pinned to a replica that left reaches another one, which refuses it (WrongReplicaError) so that the
ingress retries elsewhere.
"""

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Set

import ray
from ray import serve

from cluster.workers.stats import RoleCounters, WorkerStats

if TYPE_CHECKING:  # pragma: no cover
    from engine.outputs import CacheEvent, EngineStats

logger = logging.getLogger("ray.serve")

HEALTH_CALL_TIMEOUT_S = 30.0
"""How long a health check waits for the engine's stats: a core answers calls between two steps, so a live
one takes milliseconds; shorter than Serve's health_check_timeout_s, so the check fails with
the core's state in the replica's log rather than by Serve's timeout (cluster/app.py sets that to twice this)."""


MAX_EARLY_ABORTS = 4096


class WrongReplicaError(RuntimeError):
    """A call pinned to one replica reached another (the named one left): refused at once."""


@dataclass(frozen=True)
class WorkerInfo:
    replica_id: str
    context_len: int
    vocab_size: int


@dataclass(frozen=True)
class WorkerItem:
    """One request's news in a worker's stream to an ingress: an output, or the error that ended it."""

    rid: str
    """The rid the ingress submitted (for n > 1, every choice's outputs carry it; output.index tells them apart)."""
    output: Any = None
    """engine.outputs.StreamOutput (token ids, text "")."""
    error: Optional[BaseException] = None

    def __reduce__(self):  # one per request per engine step: a positional tuple pickles fastest
        return (WorkerItem, (self.rid, self.output, self.error))


@dataclass(frozen=True)
class WorkerReport:
    """What the router learns from one poll of one worker."""

    replica_id: str
    stats: WorkerStats
    """The replica's engine stats (queue length, running, KV usage, counters) and its own figures."""
    events: List["CacheEvent"] = field(default_factory=list)
    """engine CacheEvents drained since the previous report, in order."""
    time: float = 0.0


class OutputChannel:
    """What this worker has for one ingress replica, taken a batch at a time (one Serve message each)."""

    def __init__(self) -> None:
        self._items: List[WorkerItem] = []
        self._ready = asyncio.Event()
        self.rids: Set[str] = set()
        """Requests of this ingress that are still running here."""
        self.readers = 0

    def put(self, item: WorkerItem) -> None:
        self._items.append(item)
        self._ready.set()

    async def take(self) -> List[WorkerItem]:
        """Everything queued, waiting for at least one item."""
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return items


class WorkerBase:
    """What every pool's replica has: its engine, the ingress streams, aborts, reports and health."""

    def __init__(self, model: Optional[str], engine_options: Dict[str, Any]):
        from engine import Engine  # heavy: torch, transformers

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Token ids only: the ingress makes the text and checks stop strings.
        self.engine = Engine(model, enable_cache_events=True, detokenize=False, **engine_options)
        self._channels: Dict[str, OutputChannel] = {}
        self._early_aborts: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        """rids aborted before their submit arrived (the two calls race): their submit is refused."""
        self._served: collections.deque = collections.deque(maxlen=4096)
        """rids of recent requests (the pinning proof reads them)."""
        self._first_output_s, self._first_output_requests = 0.0, 0
        """WorkerStats.first_output_s / first_output_requests."""
        self._gpus = float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0))
        """Ray's reservation for this replica (its rank processes use them), in every report."""

    # ---- the ingress's stream ------------------------------------------------------------------
    async def outputs(self, ingress_id: str, replica_id: str) -> AsyncIterator[List[WorkerItem]]:
        """The batched stream of ingress `ingress_id` (see the module docstring); meant for `replica_id`.
        When it ends (the ingress went away), the ingress's requests here are aborted."""
        self._check_replica(replica_id)
        channel = self._channel(ingress_id)
        channel.readers += 1
        try:
            while True:
                yield await channel.take()
        finally:
            channel.readers -= 1
            if channel.readers == 0:
                self._channels.pop(ingress_id, None)
                for rid in list(channel.rids):
                    self.abort(rid)

    def _channel(self, ingress_id: str) -> OutputChannel:
        channel = self._channels.get(ingress_id)
        if channel is None:
            channel = self._channels[ingress_id] = OutputChannel()
        return channel

    def _count_first_output(self, start: float) -> None:
        self._first_output_s += time.perf_counter() - start
        self._first_output_requests += 1

    def _check_replica(self, replica_id: str) -> None:
        if replica_id != self.replica_id:
            raise WrongReplicaError(f"a call meant for replica {replica_id} reached {self.replica_id}")

    # ---- requests --------------------------------------------------------------------------------
    def abort(self, rid: str, replica_id: Optional[str] = None) -> None:
        """Abort request (or choice: "<rid>#<i>") `rid` here; a no-op when it is gone. A request not seen
        yet (its submit is still on the way) is refused when it comes. `replica_id`: the replica the abort
        is meant for; one that reached another replica (the named one left) is ignored."""
        if replica_id is not None and replica_id != self.replica_id:
            return
        if not any(rid in c.rids for c in self._channels.values()):
            self._early_aborts[rid] = None
            while len(self._early_aborts) > MAX_EARLY_ABORTS:
                self._early_aborts.popitem(last=False)
        self.engine.abort(rid)

    def _aborted_before_submit(self, rid: str) -> bool:
        return self._early_aborts.pop(rid, 0) is None

    # ---- router and health -----------------------------------------------------------------------
    async def report(self) -> WorkerReport:
        engine = await self.engine.stats_async()
        events = await self.engine.drain_cache_events_async()
        return WorkerReport(self.replica_id, self._worker_stats(engine), events, time.time())

    async def stats(self) -> WorkerStats:
        return self._worker_stats(await self.engine.stats_async())

    def _worker_stats(self, engine: "EngineStats") -> WorkerStats:
        """The engine's stats with this replica's own beside them (what the router receives)."""
        config = self.engine.config
        return WorkerStats(
            engine,
            capacity=config.admission_limit,
            gpus=self._gpus,
            tensor_parallel_size=config.tensor_parallel_size,
            first_output_s=self._first_output_s,
            first_output_requests=self._first_output_requests,
            role_counters=self._role_counters(),
        )

    def _role_counters(self) -> Optional[RoleCounters]:
        """This pool role's own counters (WorkerStats.role_counters); None for the unified pool."""
        return None

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.replica_id, self.engine.context_len, self.engine.vocab_size)

    def whoami(self) -> str:
        return self.replica_id

    def served(self) -> Dict[str, List[str]]:
        """{this replica's id: rids of its last 4096 requests} (tests prove pinning with it)."""
        return {self.replica_id: list(self._served)}

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced). A dead core
        raises at once; one that does not answer within HEALTH_CALL_TIMEOUT_S fails the check with its state
        logged, before Serve's own timeout (cluster/app.py) would."""
        try:
            await self.engine.stats_async(timeout=HEALTH_CALL_TIMEOUT_S)
        except TimeoutError:
            logger.error(
                "worker %s: the engine did not answer a health check within %.0f s (%s)",
                self.replica_id,
                HEALTH_CALL_TIMEOUT_S,
                self.engine.core_state(),
            )
            raise

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
