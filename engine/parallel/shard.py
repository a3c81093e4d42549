"""How a model is cut over the ranks of a tensor-parallel group: pure arithmetic, no communication.

Every rank holds contiguous ranges of what it shards, the same ranges on every load:

    attention   whole GQA groups: the KV heads [kv_start, kv_end) and their query heads [q_start, q_end);
                with fewer KV heads than ranks, each KV head is replicated on size // num_kv_heads ranks,
                which split that head's query heads between them
    MLP         the intermediate columns split_range(intermediate_size, size, rank)
    vocabulary  rows [rank * padded, rank * padded + padded) of the vocabulary padded to size * padded
                rows; the rows past the real vocabulary are zeros (their logits are cut off after the
                all-gather)

Ranges need not be equal (9 heads over 2 ranks: 6 and 3); row-parallel layers all-reduce outputs of one
shape whatever their input widths, and the vocabulary is padded so that the all-gather's parts agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Tuple

import torch

from engine.errors import InvalidConfigError


class TensorParallel(Protocol):
    """What a model needs of its tensor-parallel group: its place in it and the two collectives of a forward.

    Both collectives run on every rank of the group, in the same order; a model built with one calls them
    in its forward, so every rank must run the same forwards (engine.parallel.step)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (written into `x`, or a new tensor: use the returned one); every rank
        gets the same values."""
        ...

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) of every rank -> (..., size * n), rank r's part at [r * n, (r + 1) * n)."""
        ...


def split_range(n: int, parts: int, index: int) -> Tuple[int, int]:
    """[start, end) of part `index` of n items cut into `parts` contiguous ranges whose sizes differ by at most
    one (the first n % parts ranges hold one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """Query heads [q_start, q_end) and KV heads [kv_start, kv_end) of one rank (all of them at TP=1)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Rank `rank`'s attention heads (see the module docstring); InvalidConfigError when the heads cannot be cut
    over `size` ranks so that every rank holds at least one query head and the KV heads its queries read."""
    if num_heads % num_kv_heads:
        raise InvalidConfigError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_end = split_range(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    replicas = size // num_kv_heads
    if size % num_kv_heads or group < replicas:
        raise InvalidConfigError(
            f"tensor_parallel_size={size} cannot split {num_heads} attention heads ({num_kv_heads} KV heads): "
            f"with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and each KV head's "
            f"{group} query heads must cover its {replicas} ranks"
        )
    kv = rank // replicas
    q_start, q_end = split_range(group, replicas, rank % replicas)
    return HeadShard(kv * group + q_start, kv * group + q_end, kv, kv + 1)


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """InvalidConfigError unless every rank of a group of `size` gets its heads (head_shard)."""
    for rank in range(size):
        head_shard(num_heads, num_kv_heads, rank, size)


@dataclass(frozen=True)
class VocabShard:
    """Vocabulary rows [start, end) of one rank, held in the first end - start of its `padded` rows."""

    start: int
    end: int
    padded: int

    @property
    def num_valid(self) -> int:
        return self.end - self.start


def vocab_shard(vocab_size: int, rank: int, size: int) -> VocabShard:
    padded = -(-vocab_size // size)
    start = min(rank * padded, vocab_size)
    return VocabShard(start, min(start + padded, vocab_size), padded)


@dataclass(frozen=True)
class TensorSlice:
    """Elements [start, end) along `dim` of a checkpoint tensor: what one rank's parameter takes of it."""

    dim: int
    start: int
    end: int

    def take(self, source: Any) -> torch.Tensor:
        """The slice of `source`: a torch.Tensor (a view) or a safetensors slice (only these bytes are read)."""
        index = (slice(None),) * self.dim + (slice(self.start, self.end),)
        return source[index]
