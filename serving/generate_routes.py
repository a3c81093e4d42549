"""SGLang's native POST /generate, plus GET /health and GET /metrics.

/generate takes `text` or `input_ids` (one prompt or a batch) and a `sampling_params` dict with
SGLang's names. It answers one object per choice ({"text", "output_ids", "meta_info"}), a list for
a batch or n > 1; streamed, every event carries the choice's text and ids so far (SGLang's
default), then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Dict, List

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.errors import APIError
from serving.protocol import GenerateRequest, new_id
from serving.state import ServingState, get_state
from serving.streams import ChoiceState, GenerationStream, cancel_on_disconnect, collect, sse, stream_response

router = APIRouter()


async def _prompts(st: ServingState, body: GenerateRequest) -> tuple:
    """(id lists, whether the request was a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text or input_ids", "text", "invalid_request")
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if batch else [body.text]
        if not texts:
            raise APIError(400, "text must not be empty", "text", "invalid_request")
        prompts = list(await asyncio.gather(*(st.encode(t) for t in texts)))  # one batch
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = [list(p) for p in body.input_ids] if batch else [list(body.input_ids)]
    for ids in prompts:
        st.check_ids(ids, "input_ids" if body.input_ids is not None else "text")
    return prompts, batch


def _meta(rid: str, s: ChoiceState, body: GenerateRequest) -> Dict[str, Any]:
    finish = None
    if s.finish_reason is not None:
        finish = {"type": s.finish_reason}
        if s.finish_reason == "stop":
            finish["matched"] = s.matched_stop
        elif s.finish_reason == "length":
            finish["length"] = s.completion_tokens
    meta: Dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cached_tokens": s.cached_tokens,
    }
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in s.logprobs]
        meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top_logprobs] for lp in s.logprobs]
    return meta


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    st = get_state(request)
    prompts, batch = await _prompts(st, body)
    values = dict(body.sampling_params)
    if body.return_logprob:
        values.update(logprobs=True, top_logprobs=body.top_logprobs_num)
    params = st.checked_params(values)
    for ids in prompts:
        st.check_context(len(ids), params.max_new_tokens, "input_ids")
    rid = body.rid or new_id("gen")
    stream = await st.start_stream(prompts, params, rid, body.timeout, request)
    many = batch or params.n > 1
    if body.stream:
        return stream_response(stream, _events(rid, body, stream, len(prompts)))
    states = await cancel_on_disconnect(request, collect(stream, len(prompts), params.n))
    results = [
        {"text": s.full_text, "output_ids": s.token_ids, "index": k, "meta_info": _meta(rid, s, body)}
        for k, s in enumerate(states)
    ]
    return JSONResponse(results if many else results[0])


async def _events(rid: str, body: GenerateRequest, stream: GenerationStream, num_prompts: int) -> AsyncIterator[str]:
    states: List[ChoiceState] = [ChoiceState() for _ in range(num_prompts * stream.n)]
    async for i, out in stream.iterate():
        k = i * stream.n + out.index
        states[k].add(out)
        s = states[k]
        yield sse({"text": s.full_text, "output_ids": s.token_ids, "index": k, "meta_info": _meta(rid, s, body)})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while requests can be served; 503 when the backend is down or the server drains."""
    st = get_state(request)
    ok = not st.lifetimes.draining and await st.backend.health()
    return Response(status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = get_state(request)
    try:
        st.metrics.update_engine_gauges(await st.backend.stats())
    except Exception:  # noqa: BLE001 - a dead engine still lets request metrics be scraped
        pass
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)
