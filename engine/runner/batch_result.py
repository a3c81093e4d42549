"""What a forward returns: a LaunchedBatch on the device, resolved into a BatchResult on the host.

    ModelRunner.launch_batch ─▶ LaunchedBatch   sampled tokens (and logprobs) queued on the device;
                                                their copy to pinned host memory is queued behind them
    LaunchedBatch.resolve()  ─▶ BatchResult     waits for that copy (the GPU→CPU sync), host lists

Between the two the device may run more work: overlap scheduling (engine/scheduler/loops.py) launches
the next batch, whose decode inputs read `LaunchedBatch.next_token_ids` on the device, before resolving
this one. On the CPU the copies are plain tensors and `resolve` does not wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from engine.outputs import TokenLogprob


@dataclass
class BatchResult:
    """Sampled tokens of `ScheduleBatch.sampled_reqs`, in order (host lists)."""

    next_token_ids: List[int]
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[List[tuple]]] = None
    prompt_logprobs: Dict[int, List[TokenLogprob]] = field(default_factory=dict)
    """Batch index → logprobs of the prompt tokens this step scored (requests owing prompt logprobs)."""
    device_wait_s: float = 0.0
    """Seconds `LaunchedBatch.resolve` blocked waiting for the device (0 on the CPU)."""


@dataclass
class LaunchedBatch:
    """A batch whose sampling has been queued on the device; `resolve()` returns its BatchResult."""

    next_token_ids: torch.Tensor
    """(num sampled,) int64, device — the sampled tokens (what the next batch's decode inputs may read)."""
    top_logprobs_nums: List[int]
    """Top logprobs wanted per sampled row (0 = none)."""
    prompt_logprobs: Dict[int, List[TokenLogprob]]
    host: List[Optional[torch.Tensor]]
    """Host copies (in flight) of next_token_ids, logprobs, top logprob ids, top logprob values."""
    event: Optional[torch.cuda.Event] = None
    """Recorded after the copies were queued (CUDA only)."""

    @classmethod
    def start(
        cls,
        next_token_ids: torch.Tensor,
        logprobs: Optional[torch.Tensor],
        top_ids: Optional[torch.Tensor],
        top_vals: Optional[torch.Tensor],
        top_logprobs_nums: List[int],
        prompt_logprobs: Dict[int, List[TokenLogprob]],
    ) -> "LaunchedBatch":
        """Queue the device→host copies of the sampler's outputs (non-blocking: into pinned memory on CUDA)."""
        host = [
            None if t is None else t.to("cpu", non_blocking=True) for t in (next_token_ids, logprobs, top_ids, top_vals)
        ]
        event = None
        if next_token_ids.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return cls(next_token_ids, top_logprobs_nums, prompt_logprobs, host, event)

    @classmethod
    def empty(cls, device: torch.device, prompt_logprobs: Dict[int, List[TokenLogprob]]) -> "LaunchedBatch":
        """A batch that sampled nothing (only a chunk of a prompt)."""
        return cls(
            torch.empty(0, dtype=torch.int64, device=device),
            [],
            prompt_logprobs,
            [torch.empty(0, dtype=torch.int64), None, None, None],
        )

    def resolve(self) -> BatchResult:
        """Wait for the host copies (the GPU→CPU sync of this batch) and return host lists."""
        waited = 0.0
        if self.event is not None:
            start = time.perf_counter()
            self.event.synchronize()
            waited = time.perf_counter() - start
        ids, logprobs, top_ids, top_vals = self.host
        top = None
        if top_ids is not None:
            # Tokens a grammar forbids have logprob -inf: they are no candidates, so they are left out.
            top = [
                [(t, v) for t, v in zip(ti[:k], tv[:k]) if v != float("-inf")]
                for ti, tv, k in zip(top_ids.tolist(), top_vals.tolist(), self.top_logprobs_nums)
            ]
        elif logprobs is not None:
            top = [[] for _ in self.top_logprobs_nums]
        return BatchResult(
            next_token_ids=ids.tolist(),
            logprobs=None if logprobs is None else logprobs.tolist(),
            top_logprobs=top,
            prompt_logprobs=self.prompt_logprobs,
            device_wait_s=waited,
        )
