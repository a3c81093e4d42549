"""Anthropic Messages API bodies: requests (pydantic), the message object and error bodies (JSON dicts in
the shapes Anthropic documents).

Content blocks and tools stay dicts in the request models: serving/anthropic.py checks them one by one so
that a 400 names the exact block (`messages[1].content[0].type`). Unknown fields are ignored.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Union

from pydantic import Field

from serving.protocol import TIMEOUT_FIELD, _Request


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class CountTokensRequest(_Request):
    model: str = Field(..., description="The served model's name (see GET /v1/models).")
    messages: List[Dict[str, Any]] = Field(..., min_length=1, description="user / assistant turns.")
    system: Optional[Union[str, List[Dict[str, Any]]]] = Field(None, description="A string or text blocks.")
    tools: Optional[List[Dict[str, Any]]] = Field(None, description="Custom (client) tools only.")
    tool_choice: Optional[Dict[str, Any]] = Field(None, description="auto, any, tool (with name) or none.")
    thinking: Optional[Dict[str, Any]] = Field(
        None, description='{"type": "disabled"} or "adaptive" (the served model never thinks); "enabled" is refused.'
    )
    mcp_servers: Optional[List[Any]] = Field(None, description="Not supported.")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, description="Tokens to generate at most (required).")
    stop_sequences: Optional[List[str]] = Field(None, description="Strings that end generation.")
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0, description="0 = greedy. Default 1.")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=1)
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = Field(None, description="Accepted (user_id), unused.")
    service_tier: Optional[str] = Field(None, description="Accepted, unused.")
    container: Optional[Any] = Field(None, description="Not supported.")
    output_config: Optional[Dict[str, Any]] = Field(
        None, description='{"format": {"type": "json_schema", "schema": ...}} constrains the text; effort is refused.'
    )
    cache_control: Optional[Dict[str, Any]] = Field(None, description="Accepted: every prompt is prefix-cached.")
    timeout: Optional[float] = TIMEOUT_FIELD


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error type of an HTTP status; any other status is an "api_error"."""


def error_body(status: int, message: str) -> Dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def usage_object(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Dict[str, Any]:
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens = the whole prompt."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def message_object(
    mid: str,
    model: str,
    content: List[Dict[str, Any]],
    stop_reason: Optional[str],
    stop_sequence: Optional[str],
    usage: Dict[str, Any],
) -> Dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }
