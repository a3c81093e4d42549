"""The OpenAI-compatible routes: /v1/models, /v1/models/{id} (an id may hold '/'), /v1/completions
(completions.py), /v1/chat/completions (chat.py), and vLLM's POST /tokenize and /detokenize (also
served at /v1/tokenize and /v1/detokenize: the same handlers)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from serving import chat, completions
from serving.chat import template_messages
from serving.errors import APIError
from serving.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from serving.state import get_state

router = APIRouter()
router.include_router(completions.router)
router.include_router(chat.router)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    st = get_state(request)
    return ModelList(data=[ModelCard(id=st.model_name, max_model_len=st.backend.context_len)])


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def get_model(model: str, request: Request) -> ModelCard:
    st = get_state(request)
    if model != st.model_name:
        raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
    return ModelCard(id=st.model_name, max_model_len=st.backend.context_len)


@router.post("/tokenize", response_model=TokenizeResponse)
@router.post("/v1/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    st = get_state(request)
    if body.model is not None:
        st.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", "prompt", "invalid_request")
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages", "invalid_request")
        text = st.tokenizer.chat_prompt_text(
            template_messages(body.messages, False), add_generation_prompt=body.add_generation_prompt
        )
        ids = await st.encode(text, add_special_tokens=False, param="messages")
    else:
        ids = await st.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=st.backend.context_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
@router.post("/v1/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    st = get_state(request)
    if body.model is not None:
        st.check_model(body.model)
    vocab = st.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:4]}", "tokens", "invalid_request")
    return DetokenizeResponse(prompt=st.tokenizer.decode(body.tokens))
