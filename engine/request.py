"""Req: one request's tokens, sampling parameters, KV ownership and counters.

Counters instead of phase flags (positions are token indices of `fill_ids`):

    fill_ids = origin_input_ids + output_ids
    [0, prefix_len)          KV owned by the RadixCache (matched prefix, locked through last_node)
    [prefix_len, kv_len)     KV owned by this request (computed by earlier chunks / decode steps)
    [kv_len, len(fill_ids))  no KV yet: the next extend computes it

The next forward computes positions [kv_len, kv_len + extend_len): the rest of
the prompt (or a chunk of it) in a prefill, the last output token in a decode.
A retracted request keeps its output_ids and resumes with a prefill over
fill_ids, so its KV is rebuilt (mostly from the cache) and sampling continues.
Its `grammar` (structured output) has consumed exactly output_ids and is kept
as is: nothing is re-accepted on resume.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from engine.outputs import FinishReason, ReqOutput, TokenLogprob
from engine.sampling_params import SamplingParams


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: List[int],
        params: SamplingParams,
        seed: int,
        eos_token_ids: frozenset,
        on_output: Callable[[ReqOutput], None],
        wait_for: Optional["Req"] = None,
        grammar=None,
        handoff: Optional[str] = None,
    ):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.output_ids: List[int] = []
        self.sampling_params = params
        self.seed = seed
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.on_output = on_output
        """Called by the OutputProcessor with what each step produced (the EngineCore collects them)."""
        self.wait_for = wait_for
        """Another request (the first of an n>1 group) whose prompt must be cached before this one is scheduled."""
        self.grammar = grammar
        """GrammarState (runner/grammar.py) constraining the output, or None; advanced by the OutputProcessor."""
        self.handoff = handoff
        """None, or its disaggregation role (engine.scheduler.handoff): "sender" computes the prompt and
        hands its KV and first token over; "receiver" receives them and decodes."""
        # KV ownership
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.prefix_len = 0
        self.kv_len = 0
        self.extend_len = 0
        """New tokens computed by the forward being planned (set by the prefill adder)."""
        # counters and state
        self.cached_tokens = 0
        self.num_retractions = 0
        self.finish_reason: Optional[FinishReason] = None
        self.matched_stop: Any = None
        self.to_abort = False
        # produced but not yet delivered through on_output
        self.pending_logprobs: List[TokenLogprob] = []
        self.prompt_logprobs: List[TokenLogprob] = []
        """Logprobs of prompt tokens 1..n-1 (when sampling_params.prompt_logprobs is set)."""
        self.prompt_logprobs_sent = False
        self.num_emitted = 0

    @property
    def fill_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True until the logprob of every prompt token after the first has been computed."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.origin_input_ids) - 1
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_done(self) -> bool:
        """True once the KV of every prompt token has been computed at least once."""
        return self.kv_len >= len(self.origin_input_ids) or bool(self.output_ids)

    def check_finished(self, context_len: int) -> None:
        """Set finish_reason after a new output token (stop strings are the front end's: engine.text)."""
        if self.finished:
            return
        last = self.output_ids[-1]
        if last in self.eos_token_ids or last in self.stop_token_ids:
            self.finish_reason, self.matched_stop = FinishReason.STOP, last
        elif len(self.output_ids) >= self.sampling_params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.seq_len >= context_len:
            self.finish_reason = FinishReason.LENGTH

    def reset_kv_state(self) -> None:
        """Forget every KV reference (after the scheduler released them)."""
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.prefix_len = 0
        self.kv_len = 0
        self.extend_len = 0

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
            f"kv_len={self.kv_len}, prefix_len={self.prefix_len}, finish={self.finish_reason})"
        )
