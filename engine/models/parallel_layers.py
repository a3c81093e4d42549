"""Layers of a tensor-parallel model (tensor_parallel_size > 1) that talk to the other ranks.

Column-parallel layers need no class: a rank's share of qkv_proj or gate_up_proj is a plain Linear with
fewer output rows, whose input (the full hidden state) every rank holds. The layers here end with a
collective, so every rank calls them in the same order:

    RowParallelLinear        this rank's input columns -> partial (T, out), all-reduced: the full output
    VocabParallelEmbedding   ids -> rows of this rank's vocabulary shard (zeros elsewhere), all-reduced
    VocabParallelLMHead      the weight of this rank's vocabulary shard (the logits' all-gather is the model's)

At tensor_parallel_size 1 the models build plain Linear / nn.Embedding instead: no collective, no hook.
Each layer names the slice of the checkpoint tensor it holds (`source_slice`), for the loader.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Linear
from engine.parallel.shard import TensorParallel, TensorSlice, VocabShard, vocab_shard


class RowParallelLinear(Linear):
    """Input columns [in_range) of a (out_features, full in) weight; forward returns the sum over the ranks.

    Only rank 0 holds the bias (added once before the sum). x: (T, in_range width) -> (T, out_features),
    the same on every rank."""

    def __init__(self, in_range: Tuple[int, int], out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_range[1] - in_range[0], out_features, bias=bias and tp.rank == 0)
        self.in_range = in_range
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))

    def source_slice(self, attr: str) -> Optional[TensorSlice]:
        return TensorSlice(1, *self.in_range) if attr == "weight" else None


class _VocabShardRows:
    """What the loader needs of a layer whose `weight` rows are a vocabulary shard (`shard`) plus zero padding."""

    shard: VocabShard
    weight: nn.Parameter

    def source_slice(self, attr: str) -> Optional[TensorSlice]:
        return TensorSlice(0, self.shard.start, self.shard.end)

    def target_rows(self, attr: str) -> Tuple[int, int]:
        """Rows of `weight` the checkpoint slice fills; the padding rows after them stay zero."""
        return 0, self.shard.num_valid

    def zero_padding(self) -> None:
        self.weight.data[self.shard.num_valid :].zero_()


class VocabParallelEmbedding(_VocabShardRows, nn.Module):
    """Rows of this rank's vocabulary shard, `weight` (shard.padded, hidden) with zero padding rows.

    forward: ids (T,) -> (T, hidden), each row from the rank that holds its id, all-reduced (exact: the
    other ranks add zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.shard: VocabShard = vocab_shard(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(self.shard.padded, hidden_size))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.num_valid)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~inside[:, None], 0.0))


class VocabParallelLMHead(_VocabShardRows, Linear):
    """The output embedding's rows of this rank's vocabulary shard, (shard.padded, hidden), zero padding."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        shard = vocab_shard(vocab_size, tp.rank, tp.size)
        super().__init__(hidden_size, shard.padded, bias=False)
        self.shard: VocabShard = shard
