"""ScheduleBatch: the CPU plan of one step, turned into a ForwardBatch.

The plan is a list of requests, each with `kv_len` (KV already in the pool)
and `extend_len` (positions to compute now: the rest of the prompt or a chunk
of it in EXTEND, one token in DECODE). `prepare` allocates the KV slots and
builds the device tensors; the scheduler has already made sure the slots exist.

A mixed EXTEND batch (EngineConfig.enable_mixed_chunk) starts with running
requests that decode one token each (`decode_reqs`, extend_len 1), followed by
the prefills, the chunked one last:

    reqs = [decode_0 .. decode_d-1, prefill_0 .. prefill_p-1 (, chunked)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache_manager import KVCacheManager
from engine.request import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: List[Req]
    chunked_req: Optional[Req] = None
    """The request (always the last one) whose prompt continues next step: its logits are not sampled."""
    num_decode: int = 0
    """Mixed EXTEND: reqs[:num_decode] are running requests decoding one token (see the module docstring)."""
    forward_batch: Optional[ForwardBatch] = field(default=None, repr=False)

    @property
    def decode_reqs(self) -> List[Req]:
        return self.reqs[: self.num_decode]

    @property
    def prefill_reqs(self) -> List[Req]:
        return self.reqs[self.num_decode :]

    @property
    def sampled_reqs(self) -> List[Req]:
        """Requests that get a new token from this step, in batch order."""
        return self.reqs[:-1] if self.chunked_req is not None else self.reqs

    def prepare(self, kv: KVCacheManager, device: torch.device) -> ForwardBatch:
        if self.mode is ForwardMode.DECODE:
            out_loc = kv.alloc_decode(self.reqs)
            input_ids = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in self.reqs]
            positions = [r.kv_len for r in self.reqs]
        else:
            out_loc = kv.alloc_extend(self.reqs)
            # Decode rows of a mixed batch read their last token like DECODE does (overlap scheduling
            # replaces it with the token still in flight: OverlapLoop / FutureMap).
            input_ids = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in self.decode_reqs]
            positions = [r.kv_len for r in self.decode_reqs]
            for r in self.prefill_reqs:
                input_ids += r.fill_ids[r.kv_len : r.kv_len + r.extend_len]
                positions += range(r.kv_len, r.kv_len + r.extend_len)
        if out_loc is None:
            raise RuntimeError("KV allocation failed after the scheduler reserved it (scheduler bug)")
        self.forward_batch = ForwardBatch.build(
            self.mode,
            input_ids,
            positions,
            out_loc,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            seq_lens=[r.kv_len + r.extend_len for r in self.reqs],
            prefix_lens=[r.kv_len for r in self.reqs],
            device=device,
        )
        return self.forward_batch
