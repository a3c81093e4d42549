"""CudaGraphRunner: decode forwards (model + logits) captured as CUDA graphs, replayed with padding.

A decode step of a small batch is hundreds of short kernels; launching them one by one from Python costs
more than running them. The runner captures, for every batch size in `batch_sizes` (powers of two up to
`max_bs`), one graph of `model.forward` + `compute_logits` over static input buffers, and replays the
smallest graph that fits a batch:

    replay(fb):  static[:bs] <- fb's device tensors; static[bs:padded] <- padding rows
                 backend.init_forward_metadata_replay(padded batch)        (host-side planning; the
                                                                           backend of that graph's size)
                 graph[padded].replay()  ->  logits[:bs]                   (bs, vocab) float32

Padding rows decode token 0 at position 0 of a request row reserved for padding (its req_to_token row is
all zeros, so it reads slot 0) and write their K/V to slot 0, which the KVPool never hands out (page 0).
Real rows never read slot 0, so padding changes no real output. Batch sizes are powers of two so that the
Triton backend, whose split-K count follows the power-of-two bucket of the batch size, splits a batch the
same way with graphs on and off (see kernels/attention/triton.py).

The returned logits live in the graph's static output buffer: they are valid until the next replay.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List

import torch

from engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> List[int]:
    """Powers of two up to max_bs (at least [1])."""
    sizes, bs = [], 1
    while bs <= max(1, max_bs):
        sizes.append(bs)
        bs *= 2
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model,
        backend_for_bs: Callable[[int], Any],
        req_to_token_pool,
        max_bs: int,
        device: torch.device,
        pdl_for_bs: Callable[[int], bool] = lambda bs: True,
    ):
        """`backend_for_bs(bs)`: the attention backend that decode steps of `bs` rows (padded) run; each
        captured graph holds that backend's kernels (ModelRunner.decode_backend). `pdl_for_bs(bs)`: whether
        the graph of `bs` rows launches its kernels with PDL, where PDL is on (ModelRunner.decode_uses_pdl)."""
        self.model = model
        self.pdl_for_bs = pdl_for_bs
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.backends = {bs: backend_for_bs(bs) for bs in self.batch_sizes}
        for backend in self.backends.values():
            if not backend.supports_cuda_graph:
                raise ValueError(f"{type(backend).__name__} does not support CUDA graphs")
        self.max_bs = self.batch_sizes[-1]
        self.pad_row = req_to_token_pool.alloc()  # held for the runner's lifetime; its row stays zeros
        req_to_token_pool.req_to_token[self.pad_row].zero_()
        n = self.max_bs
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.zeros(n, **i64)
        self.req_pool_indices = torch.full((n,), self.pad_row, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.prefix_lens = torch.zeros(n, **i64)
        self.extend_lens = torch.ones(n, **i64)
        self.start_loc = torch.arange(n, **i64)
        self.batches: Dict[int, ForwardBatch] = {}
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: Dict[int, torch.Tensor] = {}
        self.pool = None
        start = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
                self._capture(bs)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.batch_sizes,
            time.perf_counter() - start,
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_prefix_lens=self.prefix_lens[:bs],
            extend_seq_lens=self.extend_lens[:bs],
            extend_start_loc=self.start_loc[:bs],
            seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            extend_start_loc_cpu=list(range(bs)),
            attn_backend=self.backends[bs],
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(fb))

    def _capture(self, bs: int) -> None:
        from kernels.triton import pdl  # noqa: PLC0415  (CUDA graphs are GPU-only)

        fb = self._static_batch(bs)
        fb.attn_backend.init_forward_metadata_capture(fb)
        with pdl.suspended(not self.pdl_for_bs(bs)):
            for _ in range(2):  # compile / autotune kernels outside the capture
                self._forward(fb)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(fb)
        self.pool = graph.pool()
        self.graphs[bs], self.logits[bs], self.batches[bs] = graph, out, fb

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode is ForwardMode.DECODE and 0 < fb.batch_size <= self.max_bs

    def can_run_bs(self, bs: int) -> bool:
        return 0 < bs <= self.max_bs

    def padded_size(self, bs: int) -> int:
        return next(s for s in self.batch_sizes if s >= bs)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits (fb.batch_size, vocab) float32 of a DECODE batch; valid until the next replay."""
        bs = fb.batch_size
        pbs = self.padded_size(bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        if pbs > bs:
            self.input_ids[bs:pbs].zero_()
            self.positions[bs:pbs].zero_()
            self.out_cache_loc[bs:pbs].zero_()
            self.req_pool_indices[bs:pbs].fill_(self.pad_row)
            self.seq_lens[bs:pbs].fill_(1)
        static = self.batches[pbs]
        static.seq_lens_cpu = list(fb.seq_lens_cpu) + [1] * (pbs - bs)
        static.attn_backend.init_forward_metadata_replay(static)
        self.graphs[pbs].replay()
        return self.logits[pbs][:bs]
