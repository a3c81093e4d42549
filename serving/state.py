"""ServingState: what every route shares (backend, model name, metrics, request lifetimes) and the request → engine
translation they have in common: model check, prompt → ids, context check, SamplingParams, token
strings for logprobs, usage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from fastapi import Request

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from serving.backend import ServingBackend
from serving.encoder import BatchEncoder
from serving.errors import APIError
from serving.lifetime import Lifetimes
from serving.metrics import Metrics
from serving.ratelimit import charge_tokens
from serving.protocol import PromptTokensDetails, Usage
from serving.streams import GenerationStream


@dataclass
class ServingState:
    backend: ServingBackend
    model_name: str
    metrics: Metrics
    lifetimes: Lifetimes
    """Deadlines of the requests in flight, and the drain on shutdown."""
    _token_strs: Dict[int, str] = field(default_factory=dict)
    _encoder: Optional[BatchEncoder] = field(default=None, repr=False)

    async def start_stream(
        self,
        prompts: List[List[int]],
        params: SamplingParams,
        rid: str,
        timeout_s: Optional[float],
        request: Optional[Request] = None,
    ) -> GenerationStream:
        """The GenerationStream of a validated request, bounded by its deadline (`timeout_s`, the
        server's default, the drain); 503 + Retry-After while the server drains. With rate limits, the
        tokens it may use (prompts + max_tokens per choice) are charged to the key of `request` first
        (429 when they cannot be)."""
        if request is not None:
            charge_tokens(request.scope, sum(len(p) for p in prompts) + len(prompts) * params.n * params.max_new_tokens)
        lifetime = self.lifetimes.begin(timeout_s)
        try:
            return await GenerationStream.start(self.backend, prompts, params, rid, self.metrics.timer(), lifetime)
        except BaseException:
            lifetime.end()
            raise

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    async def encode(self, text: Any, add_special_tokens: bool = True, param: str = "prompt") -> List[int]:
        """Token ids of a prompt text, encoded off the event loop and together with the texts of the
        requests that arrive meanwhile (serving/encoder.py); InvalidRequestError(param) for a text that is
        not a string of valid Unicode."""
        if self._encoder is None:
            self._encoder = BatchEncoder(self.tokenizer)
        return await self._encoder.encode(text, add_special_tokens, param)

    def check_model(self, model: Optional[str]) -> None:
        """404 model_not_found (OpenAI's and vLLM's answer) unless `model` is the served model."""
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    async def prompt_ids(self, prompt: Any) -> List[List[int]]:
        """A completions `prompt` (string, strings, ids, or lists of ids) → one id list per prompt."""
        if isinstance(prompt, str):
            prompts: List[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt", "invalid_request")
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await asyncio.gather(*(self.encode(t) for t in texts)))  # one batch
        out = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for ids in out:
            self.check_ids(ids, "prompt")
        return out

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param} must not be empty", param, "invalid_request")
        vocab = self.backend.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:4]}", param, "invalid_request")

    def check_context(self, prompt_len: int, max_tokens: Optional[int], param: str) -> int:
        """The max_tokens to use (default: the rest of the context); 400 when the request cannot fit."""
        ctx = self.backend.context_len
        if prompt_len >= ctx:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, your prompt "
                f"has {prompt_len} tokens (at least one token must be left to generate).",
                param,
                "context_length_exceeded",
            )
        if max_tokens is None:
            return ctx - prompt_len
        if prompt_len + max_tokens > ctx:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                f"the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens

    def sampling_params(
        self,
        body: Any,
        max_tokens: int,
        *,
        logprobs: bool = False,
        top_logprobs: int = 0,
        json_schema: Optional[str] = None,
        prompt_logprobs: Optional[int] = None,
        lark: Optional[str] = None,
    ) -> SamplingParams:
        """SamplingParams from an OpenAI body (plus SGLang extras); out-of-range values → 400."""
        values = dict(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            seed=body.seed,
            n=body.n,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            json_schema=json_schema,
            regex=body.regex,
            ebnf=body.ebnf,
            lark=lark,
            prompt_logprobs=prompt_logprobs,
            logit_bias=body.logit_bias,
        )
        return self.checked_params(values)

    def checked_params(self, values: Any) -> SamplingParams:
        """SamplingParams from `values` (dict), checked against the model's vocabulary; violations → 400."""
        try:
            params = SamplingParams.from_any(values)
            params.check_vocab(self.backend.vocab_size)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.param, "invalid_request") from exc
        except (TypeError, ValueError) as exc:  # a field of the wrong type (/generate's free-form dict)
            raise APIError(400, str(exc), "sampling_params", "invalid_request") from exc
        return params

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    @staticmethod
    def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Usage:
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def get_state(request: Request) -> ServingState:
    return request.app.state.serving


class UsageTracker:
    """Token counts of a request's choices as they stream; a prompt counts once however many choices."""

    def __init__(self) -> None:
        self._prompt: Dict[int, tuple] = {}
        self._completion: Dict[tuple, int] = {}

    def add(self, prompt_index: int, out: Any) -> None:
        if out.index == 0 or prompt_index not in self._prompt:
            self._prompt[prompt_index] = (out.prompt_tokens, out.cached_tokens)
        self._completion[(prompt_index, out.index)] = out.completion_tokens

    def usage(self) -> Usage:
        prompt = sum(p for p, _ in self._prompt.values())
        cached = sum(c for _, c in self._prompt.values())
        return ServingState.usage(prompt, cached, sum(self._completion.values()))
