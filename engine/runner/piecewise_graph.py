"""PiecewiseGraphRunner: prefill and mixed steps with every layer's work outside attention replayed from
CUDA graphs, attention run eagerly between them.

A prefill or mixed step cannot replay one whole graph: its attention depends on how many requests it
carries and how long each one's prompt and cache are (FlashInfer plans it on the host per step). Run
eagerly, a step of a few hundred tokens is bound by the host, which launches several hundred kernels one
by one from Python. Everything else in a layer depends only on the number of tokens T, so the runner
captures, for every token bucket (`token_buckets`), L + 1 graphs of a model with L layers:

    piece 0         embedding, then layer 0 up to its attention's inputs (norm, qkv, q/k norm, rope) and
                    the store of its K/V into the KV pool
    piece i         layer i-1 after its attention (o_proj, norm, MLP), then layer i up to its attention,
                    and the store of layer i's K/V
    piece L         layer L-1 after its attention, then the final norm

    forward(fb):  static[:T] <- fb's input ids, positions and KV slots (out_cache_loc);
                  static[T:padded] <- token 0 at position 0, slot 0
                  piece 0; for each layer i: the backend's attention over q[:T] and the pool (kv_stored)
                  -> attn_out[:T]; piece i + 1   ->  hidden[:T]

The pieces hand each other their tensors through static buffers allocated outside the graphs (the rotary
angles piece 0 computes, q, k, v, the attention output, the residual stream, the final hidden states), so
each graph's temporaries are its own and the graphs share one memory pool. The kernels that make those
tensors write them there directly: the last input norm of a piece writes the residual stream, the rotary
kernel q and k, and the backend's attention its output (`out=`); only v (a slice of the qkv product), the
first piece's residual stream and angles, and the last piece's hidden states are copied.

The K/V store runs inside the pieces (the backend's `store_kv`, the same kernel its `forward` would launch),
so that the only launches between two graphs are the attention's own. Attention sees the real T rows only:
the padding rows' values pass through the row-wise layers (norms, matmuls, rope, MLP) and never reach a real
row, and their K/V go to slot 0, the page the KV allocator reserves for padding writes, which no request
reads. A bucket's graphs run
the same matmuls on `padded` rows as an eager step of that many tokens would; within a bucket, T real rows
are computed as in an eager step of `padded`.

`capture=False` runs the pieces eagerly through the same buffers (the CPU tests of this plumbing).
Without tensor parallelism only. The hidden states returned are valid until the next forward.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Tuple

import torch

from engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> List[int]:
    """The padded step sizes, ending at `max_tokens` (at least 8): steps of 8 up to 32, of 16 up to 128, of 32
    up to 256, of 64 up to 1024 and of 128 beyond; padding adds under a quarter to a step of more than 64
    tokens."""
    top = max(8, max_tokens)
    sizes, t = [], 8
    while t < top:
        sizes.append(t)
        t += 8 if t < 32 else 16 if t < 128 else 32 if t < 256 else 64 if t < 1024 else 128
    return sizes + [top]


class PiecewiseGraphRunner:
    def __init__(self, model, max_tokens: int, device: torch.device, backend, capture: bool = True):
        """`model`: a LlamaForCausalLM without tensor parallelism, in its serving dtype. `backend`: the
        AttentionBackend of every step this runner takes (its `store_kv` is captured with its KV pool's
        buffers; `forward` refuses a step planned on another)."""
        if getattr(model, "tp", None) is not None:
            raise ValueError("piecewise CUDA graphs do not support tensor parallelism")
        self.model = model
        self.backend = backend
        self.layers = model.model.layers
        self.device = device
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        n = self.max_tokens
        embed = model.model.embed_tokens.weight
        dtype, hidden = embed.dtype, embed.shape[1]
        attn = self.layers[0].self_attn
        i64 = dict(dtype=torch.int64, device=device)
        act = dict(dtype=dtype, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.zeros(n, **i64)
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, **act)
        self.k = torch.zeros(n, attn.num_kv_heads, attn.head_dim, **act)
        self.v = torch.zeros(n, attn.num_kv_heads, attn.head_dim, **act)
        self.attn_out = torch.zeros(n, attn.q_size, **act)
        self.cos = torch.zeros(n, 1, attn.head_dim, **act)
        self.sin = torch.zeros(n, 1, attn.head_dim, **act)
        self.residual = torch.zeros(n, hidden, **act)
        self.hidden = torch.zeros(n, hidden, **act)
        self.graphs: Dict[Tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        if capture:
            start = time.perf_counter()
            with torch.inference_mode():
                for size in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                    self._capture(size)
            logger.info(
                "captured %d piecewise CUDA graphs (%d layers + 1, steps of up to %d tokens) in %.1f s",
                len(self.graphs),
                len(self.layers),
                self.max_tokens,
                time.perf_counter() - start,
            )

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode is ForwardMode.EXTEND and 0 < fb.num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        return next(s for s in self.buckets if s >= num_tokens)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states (T, hidden) of an EXTEND batch whose attention metadata is planned
        (`fb.attn_backend.init_forward_metadata(fb)`); a view of a static buffer."""
        if fb.attn_backend is not self.backend:
            raise ValueError("the step's attention backend is not the one the pieces store K/V with")
        n = fb.num_tokens
        padded = self.padded_size(n)
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        if padded > n:
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
            self.out_cache_loc[n:padded].zero_()
        for i, layer in enumerate(self.layers):
            self._run(padded, i)
            out = self.attn_out[:n].view(n, *self.q.shape[1:])
            layer_id = layer.self_attn.layer_id
            self.backend.forward(self.q[:n], self.k[:n], self.v[:n], layer_id, fb, out=out, kv_stored=True)
        self._run(padded, len(self.layers))
        return self.hidden[:n]

    def _run(self, size: int, piece: int) -> None:
        graph = self.graphs.get((size, piece))
        if graph is not None:
            graph.replay()
        else:
            self._piece(size, piece)

    def _piece(self, size: int, piece: int) -> None:
        """Piece `piece` over the first `size` rows of the static buffers."""
        model = self.model.model
        if piece == 0:
            x, residual = model.embed_tokens(self.input_ids[:size]), None
        else:
            layer = self.layers[piece - 1]
            x = layer.self_attn.o_proj(self.attn_out[:size])
            x, residual = layer.after_attention(x, self.residual[:size])
        if piece == len(self.layers):
            x, _ = model.norm(x, residual)
            self.hidden[:size].copy_(x)
            return
        if piece == 0:  # the step's rotary angles, once: every layer's piece reads them
            cos, sin = model.rotary_emb.cos_sin(self.positions[:size], self.hidden.dtype)
            self.cos[:size].copy_(cos)
            self.sin[:size].copy_(sin)
        out = (self.q[:size], self.k[:size], self.v[:size], self.residual[:size])
        layer = self.layers[piece]
        layer.before_attention(x, residual, self.cos[:size], self.sin[:size], out=out)
        self.backend.store_kv(layer.self_attn.layer_id, self.out_cache_loc[:size], self.k[:size], self.v[:size])

    def _capture(self, size: int) -> None:
        for _ in range(2):  # compile / autotune the kernels of this size outside the capture
            for piece in range(self.num_pieces):
                self._piece(size, piece)
        torch.cuda.synchronize(self.device)
        for piece in range(self.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._piece(size, piece)
            self.pool = graph.pool()
            self.graphs[(size, piece)] = graph
