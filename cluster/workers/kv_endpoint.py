"""KVEndpoint: the KV transfer backend (cluster.kv_transfer) of a prefill or decode replica, over its engine's KV
pool, and the message that carries a SenderHandoff with the KV."""

import dataclasses
import pickle
from typing import Any, Union

import numpy as np

from cluster.kv_transfer import MAX_MESSAGE_BYTES, PeerInfo, make_backend
from cluster.kv_transfer.ranked import RankedPeerInfo, RankedTransfer


def handoff_message(handoff: Any) -> bytes:
    """The SenderHandoff as the message that travels with its KV (without the source page ids, which only
    the sender needs), so that the receiver can go on as soon as the bytes have landed instead of when the
    prefill call returns; b"" when it does not fit one (large prompt_logprobs): the receiver then takes the
    handoff from the call's result."""
    message = pickle.dumps(dataclasses.replace(handoff, src_pages=np.empty(0, dtype=np.int64)))
    return message if len(message) <= MAX_MESSAGE_BYTES else b""


class KVEndpoint:
    """Mixin: a worker replica's KV transfer backend over its engine's KV pool."""

    def _init_transfer(self, role: str, backend: str, timeout_s: float) -> None:
        """The backend over the engine's KV pool: rank 0's pool in this process (the core in a thread), or the
        core process's pool mapped here (core_process with share_kv_pool: CUDA IPC, or CPU shared memory)."""
        self.transfer_timeout_s = timeout_s
        name, page_size = f"{role}-{self.replica_id}", self.engine.config.page_size
        if self.engine.config.tensor_parallel_size > 1:  # one backend per rank, each over its own heads' pages
            self.kv_slots = self.engine.runner.kv_pool.num_slots
            self.transfer = RankedTransfer(backend, name, self.engine, page_size)
        else:
            rows = self.engine.kv_pool_rows()
            self.kv_slots = rows.shape[0]
            self.transfer = make_backend(backend, name, [rows], page_size)

    async def kv_info(self) -> Union[PeerInfo, RankedPeerInfo]:
        """This replica's transfer endpoint (PeerInfo; with tensor parallelism a RankedPeerInfo, one per rank)."""
        return self.transfer.info()
