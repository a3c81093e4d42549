"""OutputProcessor: new tokens → finish checks → ReqOutput callbacks.

Per step and per request it appends the sampled token (and its logprobs),
advances the request's grammar (a completed grammar finishes it with "stop",
its stop token counted like EOS), checks EOS / stop token ids /
max_new_tokens / context length, and at the end of the step calls each
request's `on_output` once with everything new: tokens are coalesced per
step, never one callback per token of a batch. No text here: the Engine's
front end makes it and checks stop strings (engine.text), so that this CPU
work stays out of the scheduler's loop.
"""

from __future__ import annotations

import logging
from typing import List

from engine.outputs import FinishReason, ReqOutput, TokenLogprob
from engine.request import Req

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, context_len: int):
        self.context_len = context_len

    def append_token(self, req: Req, result, row: int) -> None:
        """Record the token sampled for `req` at `row` of the step's result."""
        if req.sampling_params.max_new_tokens == 0:  # prefill only (caches the prompt)
            req.finish_reason = FinishReason.LENGTH
            return
        token = result.next_token_ids[row]
        logprob = None
        if req.sampling_params.logprobs:
            logprob = TokenLogprob(token, result.logprobs[row], result.top_logprobs[row])
        self.append_sampled(req, token, logprob)

    def append_sampled(self, req: Req, token: int, logprob) -> None:
        """Record a sampled token (and its TokenLogprob when the request asked for logprobs)."""
        req.output_ids.append(token)
        if logprob is not None and req.sampling_params.logprobs:
            req.pending_logprobs.append(logprob)
        if req.grammar is not None:
            self._advance_grammar(req, token)
        req.check_finished(self.context_len)

    @staticmethod
    def _advance_grammar(req: Req, token: int) -> None:
        """Feed `token` to the request's grammar; finish on completion ("stop") or rejection ("abort")."""
        if not req.grammar.accept(token):
            # The sampler masked every forbidden token, so this means a bug (or NaN logits).
            logger.error("request %s: grammar rejected sampled token %d; finishing it", req.rid, token)
            req.finish_reason = FinishReason.ABORT
        elif req.grammar.is_terminated():
            req.finish_reason, req.matched_stop = FinishReason.STOP, token

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End `req` now (abort, or it outgrew the KV pool) and tell its caller."""
        if req.finish_reason is None:
            req.finish_reason = reason
        self.flush([req])

    def flush(self, reqs: List[Req]) -> None:
        """Deliver what each request produced since its last callback."""
        for req in reqs:
            new_ids = req.output_ids[req.num_emitted :]
            if not new_ids and not req.finished:
                continue
            out = ReqOutput(
                rid=req.rid,
                new_token_ids=new_ids,
                logprobs=req.pending_logprobs,
                finish_reason=req.finish_reason,
                matched_stop=req.matched_stop,
                prompt_tokens=len(req.origin_input_ids),
                cached_tokens=req.cached_tokens,
                completion_tokens=len(req.output_ids),
            )
            if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                out.prompt_logprobs, req.prompt_logprobs_sent = list(req.prompt_logprobs), True
            req.num_emitted = len(req.output_ids)
            req.pending_logprobs = []
            try:
                req.on_output(out)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
                logger.exception("request %s: on_output callback failed", req.rid)
