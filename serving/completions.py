"""POST /v1/completions: prompts (text or ids) → choices, JSON or SSE.

Choice index = prompt index × n + choice index (OpenAI's order). `logprobs=k` returns the legacy
format (tokens, token_logprobs, top_logprobs with k alternatives, text_offset). `echo` prepends
the prompt text; with `logprobs` it also prepends the prompt tokens' logprobs (the first prompt
token has none: null), computed by the engine's `prompt_logprobs` (as lm-eval-harness uses them).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Request

from serving.errors import APIError
from serving.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, new_id
from serving.state import ServingState, UsageTracker, get_state
from serving.streams import GenerationStream, TextEvents, cancel_on_disconnect, collect, sse, stream_response
from serving.unsupported import COMPLETION_REFUSED, refuse_unsupported

router = APIRouter()


def legacy_logprobs(
    st: ServingState, logprobs: List[Any], offset: int, out: Optional[CompletionLogprobs] = None
) -> CompletionLogprobs:
    """The legacy completions logprobs of `logprobs` (engine TokenLogprobs), text offsets from `offset`,
    appended to `out` when given."""
    out = out if out is not None else CompletionLogprobs()
    for lp in logprobs:
        tok = st.token_str(lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({st.token_str(t): v for t, v in lp.top_logprobs})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def echo_logprobs(st: ServingState, prompt_ids: List[int], prompt_logprobs: List[Any]) -> CompletionLogprobs:
    """Legacy logprobs of the echoed prompt: its first token (no logprob), then tokens 1..n-1."""
    first = st.token_str(prompt_ids[0])
    out = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    return legacy_logprobs(st, prompt_logprobs, len(first), out)


def _check(body: CompletionRequest) -> None:
    refuse_unsupported(body, COMPLETION_REFUSED)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (or be null)", "best_of", "unsupported")


@router.post(
    "/v1/completions", response_model=CompletionResponse, responses={200: {"content": {"text/event-stream": {}}}}
)
async def create_completion(body: CompletionRequest, request: Request):
    st = get_state(request)
    st.check_model(body.model)
    _check(body)
    prompts = await st.prompt_ids(body.prompt)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    for ids in prompts:
        st.check_context(len(ids), max_tokens, "prompt")
    echo_lps = body.echo and body.logprobs is not None
    params = st.sampling_params(
        body,
        max_tokens,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        prompt_logprobs=body.logprobs if echo_lps else None,
    )
    rid = new_id("cmpl")
    echo = [st.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    stream = await st.start_stream(prompts, params, rid, body.timeout, request)
    if body.stream:
        return stream_response(stream, _events(st, body, rid, stream, echo, prompts))
    states = await cancel_on_disconnect(request, collect(stream, len(prompts), params.n))
    n = params.n
    choices = []
    for k, s in enumerate(states):
        prefix = echo[k // n]
        lps = None
        if body.logprobs is not None:
            head = echo_logprobs(st, prompts[k // n], s.prompt_logprobs or []) if echo_lps else None
            lps = legacy_logprobs(st, s.logprobs, len(prefix), head)
        choices.append(
            CompletionChoice(index=k, text=prefix + s.full_text, logprobs=lps, finish_reason=s.finish_reason)
        )
    heads = states[::n]
    usage = st.usage(
        sum(s.prompt_tokens for s in heads),
        sum(s.cached_tokens for s in heads),
        sum(s.completion_tokens for s in states),
    )
    return CompletionResponse(id=rid, model=st.model_name, choices=choices, usage=usage)


async def _events(
    st: ServingState,
    body: CompletionRequest,
    rid: str,
    stream: GenerationStream,
    echo: List[str],
    prompts: List[List[int]],
) -> AsyncIterator[str]:
    n = stream.n
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    offsets: Dict[int, int] = {}
    usage = UsageTracker()
    base = {"id": rid, "object": "text_completion", "model": st.model_name}
    created = CompletionResponse(id=rid, model=st.model_name, choices=[]).created

    def chunk(choice: dict) -> dict:
        # No "usage": null here (OpenAI's completion schema has no nullable usage); only the last chunk has it.
        return {**base, "created": created, "choices": [choice]}

    plain = TextEvents(lambda k, text: chunk({"index": k, "text": text, "logprobs": None, "finish_reason": None}))
    async for i, out in stream.iterate():
        usage.add(i, out)
        k = i * n + out.index
        text = out.text
        head: Optional[CompletionLogprobs] = None
        if k not in offsets:
            text = echo[i] + text
            offsets[k] = len(echo[i])
            if body.echo and body.logprobs is not None:
                head = echo_logprobs(st, prompts[i], out.prompt_logprobs or [])
        lps: Optional[dict] = None
        if body.logprobs is not None:
            n_head = 0 if head is None else len(head.tokens)
            lps = legacy_logprobs(st, out.logprobs or [], offsets[k], head).model_dump()
            offsets[k] += sum(len(t) for t in lps["tokens"][n_head:])
        if lps is None and out.finish_reason is None:
            if text or out.new_token_ids:  # like vLLM: a chunk per step that produced tokens, even while held back
                yield plain(k, text)
            continue
        yield sse(chunk({"index": k, "text": text, "logprobs": lps, "finish_reason": out.finish_reason}))
    if include_usage:
        yield sse({**base, "created": created, "choices": [], "usage": usage.usage().model_dump()})
