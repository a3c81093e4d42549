"""SamplingParams: SGLang's field names, validated with typed errors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Union

from engine.errors import InvalidRequestError

_MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    `temperature == 0` (or `top_k == 1`) means greedy. `seed` makes sampling
    reproducible whatever the batch companions are. `top_k == -1` disables top-k.
    `stop` strings end generation and are not part of the returned text;
    `stop_token_ids` end it and are kept out of the text unless they are visible
    tokens (the token ids are returned).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    seed: Optional[int] = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    """Also return the logprob of every prompt token after the first, with this many top
    alternatives (0: the prompt token only). Such a request computes its whole prompt (no prefix reuse)."""
    # Structured output: at most one; the output is constrained to match it (xgrammar).
    json_schema: Optional[str] = None
    """A JSON schema as a JSON string; '{"type": "object"}' for any JSON object."""
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @classmethod
    def from_any(cls, value: Union["SamplingParams", Mapping[str, Any], None]) -> "SamplingParams":
        """Accept a SamplingParams, a plain dict (unknown keys rejected), or None."""
        if value is None:
            params = cls()
        elif isinstance(value, SamplingParams):
            params = dataclasses.replace(value)
        elif isinstance(value, Mapping):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
            params = cls(**dict(value))
        else:
            raise InvalidRequestError(f"sampling_params must be a SamplingParams or a dict, got {type(value).__name__}")
        params.validate()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range."""

        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(f"{name} {msg}, got {getattr(self, name)!r}", param=name)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", "must be an integer >= 0")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (disabled) or >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(
            is_int(self.top_logprobs) and 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be an integer in [0, {_MAX_TOP_LOGPROBS}]",
        )
        check(self.seed is None or is_int(self.seed), "seed", "must be an integer or None")
        check(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= _MAX_TOP_LOGPROBS),
            "prompt_logprobs",
            f"must be None or an integer in [0, {_MAX_TOP_LOGPROBS}]",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        constraints = [c for c in (self.json_schema, self.regex, self.ebnf) if c is not None]
        check(len(constraints) <= 1, "json_schema", "cannot be combined with regex or ebnf (give one constraint)")
        check(
            all(isinstance(c, str) and c for c in constraints), "json_schema", "/regex/ebnf must be non-empty strings"
        )
