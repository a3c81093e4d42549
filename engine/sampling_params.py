"""SamplingParams: SGLang's field names, validated with typed errors."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Union

from engine.errors import InvalidRequestError

_MAX_TOP_LOGPROBS = 20
MAX_N = 128
"""Choices per request: n copies of a request run at once, so n is bounded like a batch."""
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
"""Stop strings are matched against every new piece of text, so their number and length are bounded."""
SEED_LIMIT = 2**64
"""Seeds are unsigned 64-bit integers (what torch.Generator.manual_seed takes): [0, 2**64)."""
LOGIT_BIAS_LIMIT = 100.0
"""logit_bias values lie in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range)."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""Tokens one request may bias (OpenAI's limit is 300; vLLM's 1024)."""


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    `temperature == 0` (or `top_k == 1`) means greedy. `seed` makes sampling
    reproducible whatever the batch companions are. `top_k == -1` disables top-k.
    `stop` strings end generation and are not part of the returned text;
    `stop_token_ids` end it and are kept out of the text unless they are visible
    tokens (the token ids are returned). `logit_bias` maps token ids to a value added to their
    logits before sampling (after penalties, before a grammar's mask): -100 all but bans a token,
    +100 all but forces it; logprobs describe the biased distribution.
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
    logit_bias: Optional[Dict[int, float]] = None
    """Token id → additive bias in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]; ids may arrive as decimal
    strings (JSON object keys) and are converted to int."""
    prompt_logprobs: Optional[int] = None
    """Also return the logprob of every prompt token after the first, with this many top
    alternatives (0: the prompt token only). Such a request computes its whole prompt (no prefix reuse)."""
    # Structured output: at most one; the output is constrained to match it (engine/runner/grammar.py).
    json_schema: Optional[str] = None
    """A JSON schema as a JSON string; '{"type": "object"}' for any JSON object. Enforced exactly, or refused."""
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    lark: Optional[str] = None
    """An llguidance Lark grammar (it may embed JSON schemas as `%json {...}`)."""

    @property
    def constraints(self) -> List[str]:
        """The structured-output constraints set (json_schema, regex, ebnf, lark): at most one is valid."""
        return [c for c in (self.json_schema, self.regex, self.ebnf, self.lark) if c is not None]

    @property
    def constrained(self) -> bool:
        """Whether a structured-output constraint (json_schema, regex, ebnf or lark) is set."""
        return bool(self.constraints)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, Mapping):
            self.logit_bias = {_as_token_id(k): v for k, v in self.logit_bias.items()} or None

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
        """Raise InvalidRequestError naming the first field out of range (ranges needing the model's
        vocabulary: check_vocab)."""

        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(f"{name} {msg}, got {getattr(self, name)!r}", param=name)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", "must be an integer >= 0")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            check(is_real(getattr(self, name)), name, "must be a finite number")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (disabled) or >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        check(
            is_int(self.top_logprobs) and 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be an integer in [0, {_MAX_TOP_LOGPROBS}]",
        )
        check(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < SEED_LIMIT),
            "seed",
            "must be None or an integer in [0, 2**64)",
        )
        check(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= _MAX_TOP_LOGPROBS),
            "prompt_logprobs",
            f"must be None or an integer in [0, {_MAX_TOP_LOGPROBS}]",
        )
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        check(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS and _is_unicode(s) for s in self.stop),
            "stop",
            f"must be non-empty strings of valid Unicode, at most {MAX_STOP_STRING_CHARS} characters each",
        )
        check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"must hold at most {MAX_STOP_TOKEN_IDS} ids",
        )
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        self._validate_logit_bias()
        constraints = self.constraints
        check(len(constraints) <= 1, "json_schema", "cannot be combined with regex, ebnf or lark (give one constraint)")
        check(
            all(isinstance(c, str) and c and _is_unicode(c) for c in constraints),
            "json_schema",
            "/regex/ebnf/lark must be non-empty strings of valid Unicode",
        )

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {bias!r}", param="logit_bias")
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequestError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens", param="logit_bias")
        for token, value in bias.items():
            if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0):
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {token!r}", param="logit_bias")
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or abs(value) > LOGIT_BIAS_LIMIT:
                raise InvalidRequestError(
                    f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                    f"got {value!r} for token {token}",
                    param="logit_bias",
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError when top_k, a stop token id or a logit_bias token lies outside a
        `vocab_size` vocabulary."""
        bad_bias = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bad_bias:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {bad_bias[:4]}", param="logit_bias"
            )
        if self.top_k > vocab_size:
            raise InvalidRequestError(
                f"top_k must be -1 (disabled) or in [1, {vocab_size}] (the vocabulary), got {self.top_k}", param="top_k"
            )
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:4]}", param="stop_token_ids"
            )


def _as_token_id(key: Any) -> Any:
    """A logit_bias key as an int when it is one or a decimal string of one (else unchanged: validate
    refuses it)."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _is_unicode(text: str) -> bool:
    """False for a string with a lone surrogate (no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
