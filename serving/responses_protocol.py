"""OpenAI Responses API bodies: the request (pydantic) and the response objects and items (JSON dicts, the
shapes OpenAI documents for `Response`, its output items and its stream events).

Input and tool items stay dicts in the request model: serving/responses.py checks them one by one so that
a 400 names the exact item (`input[2].content[0].type`). Fields that would change the answer and are not
implemented are declared here so that they can be refused by name (UNSUPPORTED); unknown fields are
ignored, as in the rest of the API.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional, Union

from pydantic import Field

from serving.protocol import TIMEOUT_FIELD, _Request


def item_id(prefix: str) -> str:
    """OpenAI-style ids: resp_…, msg_…, fc_…, call_…"""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(_Request):
    model: str = Field(..., description="The served model's name (see GET /v1/models).")
    input: Union[str, List[Dict[str, Any]]] = Field(
        ..., description="A user message, or items: messages, function_call and function_call_output."
    )
    instructions: Optional[str] = Field(None, description="A system message put first (not carried over).")
    tools: Optional[List[Dict[str, Any]]] = Field(None, description="Function tools only.")
    tool_choice: Optional[Union[str, Dict[str, Any]]] = Field(
        None, description='"none", "auto", "required" or {"type": "function", "name": ...}.'
    )
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call (the first).")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="Default: the rest of the context.")
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, description="0 = greedy. Default 1.")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass. Default 1.")
    text: Optional[Dict[str, Any]] = Field(
        None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}.'
    )
    stream: bool = Field(False, description="Stream the response's events (server-sent events).")
    store: bool = Field(True, description="Keep the response for GET and previous_response_id.")
    previous_response_id: Optional[str] = Field(None, description="Continue this stored response's conversation.")
    metadata: Optional[Dict[str, str]] = Field(None, description="Returned with the response (and stored).")
    user: Optional[str] = Field(None, description="End-user id (accepted, unused).")
    safety_identifier: Optional[str] = Field(None, description="Accepted, unused.")
    prompt_cache_key: Optional[str] = Field(None, description="Accepted: every prompt is prefix-cached anyway.")
    service_tier: Optional[str] = Field(None, description='Only "auto" / "default".')
    truncation: Optional[str] = Field(None, description='Only "disabled" (a prompt that does not fit is a 400).')
    stream_options: Optional[Dict[str, Any]] = Field(None, description="Accepted (no obfuscation is added).")
    timeout: Optional[float] = TIMEOUT_FIELD
    # Refused when set (see UNSUPPORTED):
    background: Optional[bool] = None
    include: Optional[List[str]] = None
    reasoning: Optional[Dict[str, Any]] = None
    top_logprobs: Optional[int] = None
    max_tool_calls: Optional[int] = None
    prompt: Optional[Dict[str, Any]] = None
    conversation: Optional[Any] = None


UNSUPPORTED = {
    "background": "background responses are not supported (send background: false or leave it out)",
    "include": "include is not supported (no reasoning, file search or logprob outputs)",
    "reasoning": "reasoning options are not supported (the served model does not reason)",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "max_tool_calls is not supported",
    "prompt": "prompt templates are not supported (send input and instructions)",
    "conversation": "conversation objects are not supported (use previous_response_id)",
}
"""Request fields refused when set to anything but their neutral value (None, false, [], 0)."""


def usage_object(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def text_part(text: str) -> Dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text_parts: List[Dict[str, Any]], status: str) -> Dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": text_parts}


def function_call_item(fid: str, call_id: str, name: str, arguments: str, status: str) -> Dict[str, Any]:
    return {
        "id": fid,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    rid: str,
    body: ResponsesRequest,
    model: str,
    created_at: int,
    status: str,
    output: List[Dict[str, Any]],
    usage: Optional[Dict[str, Any]],
    text_format: Dict[str, Any],
) -> Dict[str, Any]:
    """The Response object of request `body` (status "in_progress", "completed" or "incomplete")."""
    tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format},
        "tool_choice": tool_choice,
        "tools": body.tools or [],
        "top_logprobs": 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
    }


def now() -> int:
    return int(time.time())
