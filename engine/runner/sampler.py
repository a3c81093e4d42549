"""Sampler: turns one batch of next-token logits into next token ids (and logprobs).

Data flow of one call; every stage is batched tensor work on `logits.device`:

    logits (bs, V) ─ penalties ─ logit_bias ─ grammar mask (rows with a grammar) ─▶ z
    z ─┬─▶ log_softmax ─▶ logprobs / top logprobs
       ├─▶ argmax ─────────────────────────▶ greedy rows
       └─ ÷ temperature ─ top-k ─ top-p ─ min-p ─ + Gumbel(seed, step, v) ─ argmax ─▶ other rows

Logprobs are the log-softmax of the logits *after penalties and logit_bias, before
temperature and filtering*: they describe the model's (penalised, biased) distribution,
not the truncated one sampled from. With no penalties they equal the raw model logprobs
(vLLM's default). Grammar rows (structured output) are masked first, as in SGLang:
their logprobs are over the allowed tokens, and greedy takes the allowed argmax.

Randomness is counter-based: the uniform for (row i, token v) is a pure integer
hash of (seeds[i], steps[i], v). A seeded request therefore draws the same
token whatever its batch companions, batch size or row. No torch.Generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from engine.runner.grammar import GrammarState, VocabMask, build_vocab_mask
from engine.sampling_params import SamplingParams

# --- counter-based hash ------------------------------------------------------------------
# Values live in [0, 2^32) inside int64 tensors. `_mix32` is an xorshift-multiply
# finalizer (the structure of MurmurHash3's fmix32) with the odd multipliers
# 0x21F0AAAD and 0x735A2D97 and shifts 16/15/15, a low-bias pair published by the
# hash-prospector project. Both multipliers are < 2^31, so x * c < 2^63: no int64
# overflow on any device. `_mix32` is a bijection on 32 bits with mix(0) == 0,
# hence the non-zero domain constants below (golden-ratio and PCG-style odd words).
_M32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0x21F0AAAD, 0x735A2D97
_SEED_SALT = 0x9E3779B9  # first word absorbed with the low seed bits
_TOKEN_SALT = 0x5851F42D  # derives the second-round key from the row key
_SEED_MOD = 1 << 63  # seeds are stored reduced mod 2^63 (any Python int is accepted)
TOPK_FAST_MAX = 1024  # top-k up to this runs on torch.topk candidates instead of a vocabulary sort


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor with values in [0, 2^32) -> same shape, avalanche-mixed, same range."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 15)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds, steps: (bs,) int64, >= 0 -> (bs, 1) int64 in [0, 2^32).

    Absorbs seed low word, seed high word, then the step, each through a bijective
    mix, so for one seed distinct steps (< 2^32) always give distinct keys.
    """
    k = _mix32((seeds & _M32) ^ _SEED_SALT)
    k = _mix32(k ^ (seeds >> 32))
    k = _mix32(k ^ (steps & _M32))
    return k.unsqueeze(1)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(bs, V) float32 uniforms in [2^-24, 1 - 2^-24]; entry (i, v) depends only on
    (seeds[i], steps[i], v). Two hash rounds keyed by the row key."""
    k1 = _row_keys(seeds, steps)
    k2 = _mix32(k1 ^ _TOKEN_SALT)
    v = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    x = _mix32(_mix32(v ^ k1) ^ k2)
    # Top 23 bits + 1/2, scaled by 2^-23: exact in float32 and strictly inside (0, 1).
    return ((x >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(bs, V) float32 standard Gumbel noise -log(-log u) from `uniform_noise`."""
    return -torch.log(-torch.log(uniform_noise(seeds, steps, vocab_size)))


# --- per-batch parameters ------------------------------------------------------------------
@dataclass
class PenaltyInfo:
    """Penalty parameters and token statistics; a tensor is None when no row uses it."""

    repetition: Optional[torch.Tensor]
    """(bs, 1) float32 — HF/CTRL repetition penalty (1.0 = off)."""
    seen_mask: Optional[torch.Tensor]
    """(bs, V) bool — token occurs in the prompt or the output (repetition penalty)."""
    frequency: Optional[torch.Tensor]
    """(bs, 1) float32 — subtracted once per occurrence in the output."""
    presence: Optional[torch.Tensor]
    """(bs, 1) float32 — subtracted once if the token occurs in the output."""
    output_counts: Optional[torch.Tensor]
    """(bs, V) float32 — occurrences of each token in the output ids."""

    def apply_(self, logits: torch.Tensor) -> None:
        """Penalise `logits` (bs, V) float32 in place (repetition first, then OpenAI)."""
        if self.repetition is not None:
            rep = torch.where(self.seen_mask, self.repetition, 1.0)
            logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
        if self.output_counts is not None:
            logits -= self.frequency * self.output_counts + self.presence * (self.output_counts > 0)


@dataclass
class LogitBias:
    """The batch's logit_bias entries as a sparse (row, token, value) list; built only when some row has one."""

    rows: torch.Tensor
    """(nnz,) int64 — batch rows."""
    tokens: torch.Tensor
    """(nnz,) int64 — token ids, < V (SamplingParams.check_vocab)."""
    values: torch.Tensor
    """(nnz,) float32 — added to logits[rows, tokens]."""

    def apply_(self, logits: torch.Tensor) -> None:
        """Add the biases to `logits` (bs, V) float32 in place (one scatter, any device)."""
        logits.index_put_((self.rows, self.tokens), self.values, accumulate=True)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device) -> Optional["LogitBias"]:
        entries = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
        if not entries:
            return None
        rows, tokens, values = zip(*entries)
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            tokens=torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True),
            values=torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True),
        )


def _token_hits(ids: Sequence[Sequence[int]], vocab_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(bs, V) counts of each token id per row, by scatter_add over a padded id tensor.

    Padding uses the id V, a spare column dropped at the end.
    """
    bs, width = len(ids), max((len(r) for r in ids), default=0)
    counts = torch.zeros(bs, vocab_size + 1, dtype=dtype, device=device)
    if width:
        padded = torch.tensor([list(r) + [vocab_size] * (width - len(r)) for r in ids], dtype=torch.int64)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=dtype, device=device))
    return counts[:, :vocab_size]


@dataclass
class SamplingBatchInfo:
    """Device tensors of one batch's sampling parameters, row i = request i.

    Greedy rows (temperature 0 or top_k 1) hold neutral values (temperature 1,
    filters off) and are answered by argmax; the need_* flags let the sampler
    skip filters no sampled row uses.
    """

    temperatures: torch.Tensor
    """(bs, 1) float32 — 1.0 for greedy rows."""
    top_ps: torch.Tensor
    """(bs,) float32 — 1.0 when disabled."""
    top_ks: torch.Tensor
    """(bs,) int64 — vocab size when disabled."""
    min_ps: torch.Tensor
    """(bs,) float32 — 0.0 when disabled."""
    seeds: torch.Tensor
    """(bs,) int64 — effective seed reduced mod 2^63."""
    steps: torch.Tensor
    """(bs,) int64 — output tokens the request already generated."""
    greedy_mask: torch.Tensor
    """(bs,) bool — rows answered by argmax."""
    is_all_greedy: bool
    has_greedy: bool
    """Some row is greedy (a host flag: the sampler never reads device tensors back to decide)."""
    max_top_k: int
    """Largest top-k of the sampled rows (vocab size when some sampled row has none)."""
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    penalties: Optional[PenaltyInfo]
    return_logprobs: bool
    top_logprobs_nums: List[int]
    """Top logprobs wanted per row (0 = none); the sampler computes max() of them for all rows."""
    vocab_size: int
    vocab_mask: Optional[VocabMask] = None
    """Allowed tokens of the rows with a grammar (None when no row has one)."""
    logit_bias: Optional[LogitBias] = None
    """The rows' logit_bias entries (None when no row has one)."""

    @property
    def batch_size(self) -> int:
        return len(self.top_logprobs_nums)

    @property
    def max_top_logprobs(self) -> int:
        return max(self.top_logprobs_nums, default=0)

    @classmethod
    def build(
        cls,
        params: List[SamplingParams],
        seeds: List[int],
        steps: List[int],
        output_ids: List[List[int]],
        prompt_ids: List[List[int]],
        vocab_size: int,
        device,
        grammars: Optional[Sequence[Optional[GrammarState]]] = None,
    ) -> "SamplingBatchInfo":
        """Gather per-request parameters into device tensors.

        `seeds[i]` is request i's effective seed (the engine draws one when unseeded);
        `steps[i]` is len(output_ids[i]) in normal decoding. Token statistics are built
        only when some request uses a penalty. `grammars[i]` (optional) constrains row i;
        its bitmask is filled here, from the grammar's current state.
        """
        bs = len(params)
        assert len(seeds) == len(steps) == len(output_ids) == len(prompt_ids) == bs
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        top_ks = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]

        # Non-blocking host-to-device copies: a blocking one would wait for the batch still running on the
        # device (overlap scheduling builds this while the previous batch runs).
        def f32(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

        def i64(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            temperatures=f32([1.0 if g else p.temperature for p, g in zip(params, greedy)]).view(bs, 1),
            top_ps=f32([1.0 if g else p.top_p for p, g in zip(params, greedy)]),
            top_ks=i64(top_ks),
            min_ps=f32([0.0 if g else p.min_p for p, g in zip(params, greedy)]),
            seeds=i64([s % _SEED_MOD for s in seeds]),
            steps=i64(steps),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True),
            is_all_greedy=all(greedy),
            has_greedy=any(greedy),
            max_top_k=max((k for k, g in zip(top_ks, greedy) if not g), default=vocab_size),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            penalties=cls._build_penalties(params, output_ids, prompt_ids, vocab_size, device),
            return_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            top_logprobs_nums=[p.top_logprobs for p in params],
            vocab_size=vocab_size,
            vocab_mask=build_vocab_mask(grammars, vocab_size, torch.device(device)) if grammars else None,
            logit_bias=LogitBias.build(params, device),
        )

    @staticmethod
    def _build_penalties(params, output_ids, prompt_ids, vocab_size, device) -> Optional[PenaltyInfo]:
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_openai = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        if not (use_rep or use_openai):
            return None
        bs = len(params)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device).view(bs, 1)

        info = PenaltyInfo(None, None, None, None, None)
        if use_rep:
            info.repetition = column("repetition_penalty")
            seen = [list(o) + list(q) for o, q in zip(output_ids, prompt_ids)]
            info.seen_mask = _token_hits(seen, vocab_size, torch.int32, device) > 0
        if use_openai:
            info.frequency = column("frequency_penalty")
            info.presence = column("presence_penalty")
            info.output_counts = _token_hits(output_ids, vocab_size, torch.float32, device)
        return info


@dataclass
class SampleOutput:
    """What the sampler returns for one batch; row i = request i."""

    next_token_ids: torch.Tensor
    """(bs,) int64 — the chosen tokens."""
    logprobs: Optional[torch.Tensor] = None
    """(bs,) float32 — log-softmax of the penalised, pre-temperature logits at the chosen token."""
    top_logprob_ids: Optional[torch.Tensor] = None
    """(bs, k_max) int64 — best tokens by the same logprobs, descending; row i uses its first k_i."""
    top_logprob_vals: Optional[torch.Tensor] = None
    """(bs, k_max) float32 — their logprobs."""


# --- the sampler ---------------------------------------------------------------------------
def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """(bs, V) float32 -> (bs,) int64 greedy ids: chunked in parallel on CUDA (kernels/triton/sampling.py)."""
    if logits.is_cuda:
        from kernels.triton.sampling import argmax  # noqa: PLC0415  (imports triton: GPU path only)

        return argmax(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Stateless batched sampler. `logits` (bs, V) float32 may be modified in place."""

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        if logits.dtype != torch.float32:
            logits = logits.float()
        assert logits.shape == (info.batch_size, info.vocab_size), (tuple(logits.shape), info.vocab_size)
        if info.penalties is not None:
            info.penalties.apply_(logits)
        if info.logit_bias is not None:
            info.logit_bias.apply_(logits)
        if info.vocab_mask is not None:
            info.vocab_mask.apply_(logits)
        logprobs_all = torch.log_softmax(logits, dim=-1) if info.return_logprobs else None

        if info.is_all_greedy:
            next_ids = _argmax(logits)
        else:
            greedy_ids = _argmax(logits) if info.has_greedy else None
            next_ids = self._sample(logits, info)
            if greedy_ids is not None:
                next_ids = torch.where(info.greedy_mask, greedy_ids, next_ids)

        out = SampleOutput(next_token_ids=next_ids)
        if logprobs_all is not None:
            out.logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if info.max_top_logprobs > 0:
                vals, ids = logprobs_all.topk(info.max_top_logprobs, dim=-1)
                out.top_logprob_vals, out.top_logprob_ids = vals, ids
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """(bs, V) float32 penalised logits -> (bs,) int64 sampled ids (greedy rows: ignore)."""
        logits.div_(info.temperatures)
        if info.need_top_k and info.max_top_k <= TOPK_FAST_MAX:
            logits = self._filter_top_k_first(logits, info)
        elif info.need_top_k or info.need_top_p:
            logits.masked_fill_(self._filter_mask(logits, info), float("-inf"))
        elif info.need_min_p:
            probs = torch.softmax(logits, dim=-1)
            logits.masked_fill_(
                probs < probs.max(dim=-1, keepdim=True).values * info.min_ps.unsqueeze(1), float("-inf")
            )
        # Gumbel-max: argmax(logits / T + G) is an exact draw from softmax(logits / T).
        if logits.is_cuda:  # one fused pass (kernels/triton/sampling.py), same noise
            from kernels.triton.sampling import gumbel_argmax  # noqa: PLC0415

            return gumbel_argmax(logits, _row_keys(info.seeds, info.steps).squeeze(1))
        return (logits + gumbel_noise(info.seeds, info.steps, logits.shape[1])).argmax(dim=-1)

    @staticmethod
    def _filter_top_k_first(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Top-k, then top-p and min-p, without sorting the vocabulary: every sampled row keeps at most
        max_top_k (<= TOPK_FAST_MAX) tokens, so the filters run on the best max_top_k candidates of each
        row (torch.topk) and the result is scattered back into a row of -inf. Same keep-set as
        `_filter_mask` (up to the order of exactly tied logits)."""
        vals, idx = logits.topk(info.max_top_k, dim=-1, sorted=True)
        rank = torch.arange(info.max_top_k, device=logits.device).unsqueeze(0)
        mask = rank >= info.top_ks.unsqueeze(1)
        if info.need_top_p or info.need_min_p:
            probs = torch.softmax(vals.masked_fill(mask, float("-inf")), dim=-1)
            if info.need_top_p:
                before = probs.cumsum(dim=-1) - probs
                mask |= (before > info.top_ps.unsqueeze(1)) & (info.top_ps < 1.0).unsqueeze(1)
            if info.need_min_p:
                mask |= probs < probs[:, :1] * info.min_ps.unsqueeze(1)
        out = torch.full_like(logits, float("-inf"))
        return out.scatter_(1, idx, vals.masked_fill(mask, float("-inf")))

    @staticmethod
    def _filter_mask(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """(bs, V) bool — tokens removed by top-k, then top-p, then min-p (HF warper order).

        Works on the descending sort: sorted position 0 (the best token) is never masked,
        so every row keeps at least one token. Top-p acts on the distribution renormalised
        after top-k; min-p keeps p >= min_p * p_max (a ratio, so renormalising cannot change it).
        """
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if info.need_top_k:
            mask |= rank >= info.top_ks.unsqueeze(1)
        if info.need_top_p or info.need_min_p:
            probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
            if info.need_top_p:
                # Mass strictly before this token already exceeds top_p -> drop it (top_p = 1: never).
                before = probs.cumsum(dim=-1) - probs
                mask |= (before > info.top_ps.unsqueeze(1)) & (info.top_ps < 1.0).unsqueeze(1)
            if info.need_min_p:
                mask |= probs < probs[:, :1] * info.min_ps.unsqueeze(1)
        return torch.zeros_like(mask).scatter_(1, order, mask)
