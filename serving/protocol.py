"""OpenAI and SGLang request / response bodies (pydantic).

Request models describe what the routes accept, so the OpenAPI document (and a
fuzzer reading it) knows every field. Ranges that OpenAI documents are checked
here (a violation is a 400); everything the engine checks again
(`SamplingParams.validate`) stays the engine's contract. Unknown fields are
ignored, as OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from engine.sampling_params import LOGIT_BIAS_LIMIT, MAX_N

StopField = Optional[Union[str, List[str]]]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


TIMEOUT_FIELD = Field(
    None,
    gt=0.0,
    le=86400.0,
    description="Seconds this request may take, queueing included (the server's default applies too; the "
    "earlier wins). Past it the request is aborted: a 504, or an error event in a stream.",
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and `choices: []`).")


class SGLangExtras(_Request):
    """SGLang-style sampling fields accepted on top of OpenAI's (send them in `extra_body`)."""

    top_k: int = Field(-1, description="Sample from the k most likely tokens; -1 disables.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p × the top probability.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="Multiplicative penalty on seen tokens (1 = off).")
    regex: Optional[str] = Field(None, description="Constrain the output to this regular expression.")
    ebnf: Optional[str] = Field(None, description="Constrain the output to this EBNF grammar.")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the returned text.")
    stop_token_ids: Optional[List[int]] = Field(None, description="Token ids that end generation.")


class _SamplingFields(SGLangExtras):
    model: str = Field(..., description="The served model's name (see GET /v1/models).")
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, description="0 = greedy. Default 1.")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass. Default 1.")
    n: int = Field(1, ge=1, le=MAX_N, description="Choices per prompt.")
    stop: StopField = Field(None, description="Up to 4 strings that end generation (not returned).")
    seed: Optional[int] = Field(None, description="Makes sampling reproducible.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = Field(
        None,
        description=f"Token id (as a string) → a bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] added to its "
        "logit before sampling: -100 bans a token, +100 all but forces it.",
    )
    user: Optional[str] = Field(None, description="End-user id (accepted, unused).")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: Optional[StreamOptions] = None
    timeout: Optional[float] = TIMEOUT_FIELD


# ---- /v1/completions -------------------------------------------------------------------------
PromptField = Union[str, List[str], List[int], List[List[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField = Field(..., description="A string, strings, token ids, or lists of token ids.")
    max_tokens: Optional[int] = Field(16, ge=0, description="Tokens to generate per choice (default 16).")
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="Return this many top alternatives per token.")
    echo: bool = Field(False, description="Prepend the prompt to the returned text.")
    suffix: Optional[str] = Field(None, description="Not supported; must be null.")
    best_of: Optional[int] = Field(None, description="Only best_of == n (or null) is supported.")


class CompletionLogprobs(BaseModel):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


# ---- /v1/chat/completions --------------------------------------------------------------------
class ContentPart(_Request):
    type: str = Field(..., description="Only 'text' parts are supported.")
    text: Optional[str] = None


class FunctionCall(_Request):
    name: str
    arguments: str = Field("{}", description="The arguments as a JSON string.")


class ToolCall(_Request):
    id: str = Field(default_factory=lambda: new_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionDefinition(_Request):
    name: str = Field(..., min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Optional[int] = Field(None, ge=0, description="Default: the rest of the context.")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = Field(
        None, description="false: at most one tool call per choice (true, the default, permits several)."
    )
    # Accepted, with no effect on the output by definition (OpenAI bookkeeping and hints).
    metadata: Optional[Dict[str, str]] = Field(None, description="Accepted, unused (nothing is stored).")
    safety_identifier: Optional[str] = Field(None, description="End-user id (accepted, unused).")
    prompt_cache_key: Optional[str] = Field(None, description="Accepted, unused: prefix caching is automatic.")
    # Refused unless null or the value that means the default (serving/unsupported.py).
    functions: Optional[Any] = Field(None, description="Refused (deprecated): use tools.")
    function_call: Optional[Any] = Field(None, description="Refused (deprecated): use tool_choice.")
    modalities: Optional[List[str]] = Field(None, description='Only ["text"].')
    audio: Optional[Any] = Field(None, description="Refused: no audio output.")
    verbosity: Optional[str] = Field(None, description='Only "medium" (the default).')
    reasoning_effort: Optional[str] = Field(None, description="Refused: the served model does not reason.")
    web_search_options: Optional[Any] = Field(None, description="Refused: no web search.")
    prediction: Optional[Any] = Field(None, description="Refused: no predicted outputs.")
    service_tier: Optional[str] = Field(None, description='Only "auto" or "default" (one tier).')
    store: Optional[bool] = Field(None, description="Only false: nothing is stored.")
    prompt_cache_retention: Optional[str] = Field(None, description='Only "in_memory" (the radix cache).')
    prompt_cache_options: Optional[Any] = Field(None, description="Refused.")
    moderation: Optional[Any] = Field(None, description="Refused: no moderation.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant header.")
    continue_final_message: bool = Field(False, description="Continue the last (assistant) message.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[List[TokenLogprobEntry]] = None
    refusal: Optional[List[TokenLogprobEntry]] = None
    """Always null: the server never refuses (OpenAI's schema requires the field)."""


class AssistantMessage(BaseModel):
    """A chat choice's message. `refusal` is always null and always present (required by OpenAI's
    schema); `tool_calls` is left out when there are none (the schema allows an array or nothing)."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: SerializerFunctionWrapHandler) -> Dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatChoice]
    usage: Optional[Usage] = None


# ---- models, tokenizer, native /generate -------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixserve"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="Text to tokenize (or give `messages`).")
    messages: Optional[List[ChatMessage]] = Field(None, description="Chat messages, rendered through the template.")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: List[int]


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: List[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class GenerateRequest(_Request):
    """SGLang's native /generate: give `text` or `input_ids` (one prompt or a batch)."""

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Dict[str, Any] = Field(default_factory=dict, description="SGLang SamplingParams fields.")
    stream: bool = False
    rid: Optional[str] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    timeout: Optional[float] = TIMEOUT_FIELD
