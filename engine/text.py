"""Text: the one place where output token ids become text and stop strings end a choice.

    StreamOutput (token ids, logprobs, finish; text "") ──OutputText.apply──▶ the same output with
        its text; at a stop string: cut after the token that completed it, finish_reason "stop",
        matched_stop = the string, and the choice is over here (the caller aborts it in the engine,
        which may have produced a few more tokens meanwhile: they are dropped here)

The EngineCore streams token ids only; the Engine's front end (single node) and the cluster's
ingress (which receives its workers' token ids) both make text with this class, one
engine.tokenizer.TextStream per choice, so the text, the stop point and completion_tokens are the
same wherever a request runs. It keeps detokenization out of the scheduler's loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from engine.tokenizer import TextStream


class OutputText:
    """The text of one request's choices, made from the token ids its worker streams."""

    def __init__(self, tokenizer: Any, input_ids: List[int], params: Any):
        self.texts = [
            TextStream(tokenizer, input_ids, params.skip_special_tokens, params.stop) for _ in range(params.n)
        ]
        self.done = [False] * params.n
        """Per choice: its last output has been returned (finished on the worker, or stopped here)."""

    def apply(self, out: Any) -> Optional[Any]:
        """`out` (an engine.StreamOutput without text) with its text, cut at a stop string; None when its
        choice has already ended here (outputs the worker made before it heard of the stop)."""
        i = out.index
        if self.done[i]:
            return None
        text, pieces = self.texts[i], []
        for k, token in enumerate(out.new_token_ids):
            emit, matched = text.feed(token)
            pieces.append(emit)
            if matched is not None:
                self.done[i] = True
                extra = len(out.new_token_ids) - (k + 1)
                return dataclasses.replace(
                    out,
                    new_token_ids=out.new_token_ids[: k + 1],
                    text="".join(pieces),
                    logprobs=None if out.logprobs is None else out.logprobs[: k + 1],
                    finish_reason="stop",
                    matched_stop=matched,
                    completion_tokens=out.completion_tokens - extra,
                )
        if out.finish_reason is not None:
            self.done[i] = True
            pieces.append(text.finish())
        return dataclasses.replace(out, text="".join(pieces))

    def stopped_here(self, out: Any) -> bool:
        """True when `out` (returned by apply) ended its choice at a stop string the worker does not know
        about: the worker is still generating it."""
        return out.finish_reason == "stop" and isinstance(out.matched_stop, str)

    @property
    def finished(self) -> bool:
        return all(self.done)
