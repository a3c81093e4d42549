"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

    MessagesRequest ──chat_request──▶ ChatCompletionRequest (system first, user / assistant turns with
        their tool_use as tool calls and tool_result as tool messages, custom tools, tool_choice auto /
        any / tool / none) ──chat_bridge──▶ the chat route's plan, engine stream and tool parsing
        ──▶ a message object (text and tool_use blocks), or its stream events

Stop reasons: "tool_use" (a call parsed), "max_tokens" (length), "stop_sequence" (one of
`stop_sequences` matched; `stop_sequence` names it), else "end_turn". Errors under /v1/messages leave in
Anthropic's shape, {"type": "error", "error": {"type", "message"}}, whatever produced them (validation,
the API-key check, body size, rate limits): `AnthropicErrorShape` rewrites the OpenAI-shaped bodies.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    message_id,
    message_object,
    usage_object,
)
from serving.chat import plan_chat
from serving.chat_bridge import Delta, chat_deltas, prepare_chat, run_chat
from serving.errors import APIError, bad_request, to_api_error
from serving.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, Tool, ToolCall
from serving.state import get_state
from serving.streams import GenerationStream, SSEResponse, cancel_on_disconnect

router = APIRouter()

PATH_PREFIX = "/v1/messages"
_RENAME = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format"}


def _bad(message: str, param: str) -> APIError:
    return bad_request(f"{param}: {message}", param)


def _text_of(blocks: Any, param: str) -> str:
    """Text blocks (or a string) as one string."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad("must be a string or a list of text blocks", param)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"content block type {kind!r} is not supported here (text blocks only)", f"{param}[{j}]")
        texts.append(block["text"])
    return "\n".join(texts)


def _turn(i: int, turn: Any) -> List[ChatMessage]:
    """The chat messages of one Anthropic turn: a user turn's tool_result blocks become tool messages (first),
    its text a user message; an assistant turn's text and tool_use blocks one assistant message."""
    param = f"messages[{i}]"
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise _bad("role must be user or assistant", f"{param}.role")
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content blocks", f"{param}.content")
    texts: List[str] = []
    calls: List[ToolCall] = []
    results: List[ChatMessage] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _bad("tool_use needs string id and name", where)
            if not isinstance(block.get("input", {}), dict):
                raise _bad("tool_use input must be an object", f"{where}.input")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(ToolCall(id=block["id"], function=FunctionCall(name=block["name"], arguments=arguments)))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad("tool_result needs a string tool_use_id", where)
            text = _text_of(block.get("content", ""), f"{where}.content")
            results.append(ChatMessage(role="tool", tool_call_id=block["tool_use_id"], content=text))
        else:
            raise _bad(f"content block type {kind!r} is not supported in a {role} turn", f"{where}.type")
    if role == "assistant":
        return [ChatMessage(role="assistant", content="\n".join(texts) if texts else None, tool_calls=calls or None)]
    return results + ([ChatMessage(role="user", content="\n".join(texts))] if texts or not results else [])


def _tools(specs: Optional[List[Dict[str, Any]]]) -> Optional[List[Tool]]:
    if specs is None:
        return None
    tools = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or spec.get("type") not in (None, "custom"):
            kind = spec.get("type") if isinstance(spec, dict) else None
            raise _bad(f"tool type {kind!r} is not supported (custom tools only)", f"tools[{i}].type")
        fn = {"name": spec.get("name"), "parameters": spec.get("input_schema")}
        if spec.get("description") is not None:
            fn["description"] = spec["description"]
        try:
            tools.append(Tool.model_validate({"type": "function", "function": fn}))
        except ValidationError as exc:
            raise _bad(f"invalid tool: {exc.errors()[0]['msg']}", f"tools[{i}]") from exc
    return tools


def _tool_choice(choice: Optional[Dict[str, Any]]) -> Tuple[Any, bool]:
    """(the chat tool_choice, whether parallel calls are disabled)."""
    if choice is None:
        return None, False
    kind = choice.get("type")
    single = bool(choice.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return kind, single
    if kind == "any":
        return "required", single
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, single
    raise _bad("type must be auto, any, tool (with a name) or none", "tool_choice")


def _check_unsupported(body: CountTokensRequest) -> None:
    if body.thinking is not None and body.thinking.get("type") not in ("disabled", "adaptive"):
        raise _bad("extended thinking is not supported (the served model does not reason)", "thinking")
    if body.mcp_servers:
        raise _bad("MCP servers are not supported", "mcp_servers")
    if getattr(body, "container", None) is not None:
        raise _bad("containers are not supported", "container")
    if (getattr(body, "output_config", None) or {}).get("effort") is not None:
        raise _bad("effort is not supported (the served model does not reason)", "output_config.effort")


def _response_format(body: CountTokensRequest) -> Optional[Dict[str, Any]]:
    """output_config.format (a JSON schema for the text) as the chat route's response_format."""
    fmt = (getattr(body, "output_config", None) or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad('must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request answering `body` (`disable_parallel_tool_use`: parallel_tool_calls false)."""
    _check_unsupported(body)
    messages = [ChatMessage(role="system", content=_text_of(body.system, "system"))] if body.system else []
    for i, turn in enumerate(body.messages):
        messages += _turn(i, turn)
    choice, single = _tool_choice(body.tool_choice)
    fields: Dict[str, Any] = dict(
        model=body.model,
        messages=messages,
        tools=_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=False if single else None,
    )
    if isinstance(body, MessagesRequest):
        fields.update(
            max_completion_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            timeout=body.timeout,
            response_format=_response_format(body),
        )
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        raise _bad(exc.errors()[0]["msg"], "messages") from exc


def _stop(last: Delta) -> Tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of the last delta."""
    if last.calls:
        return "tool_use", None
    if last.finish == "length":
        return "max_tokens", None
    if isinstance(last.matched_stop, str):
        return "stop_sequence", last.matched_stop
    return "end_turn", None


def _tool_use(call: ToolCall) -> Dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": json.loads(call.function.arguments)}


@router.post(PATH_PREFIX, responses={200: {"content": {"text/event-stream": {}}}})
async def create_message(body: MessagesRequest, request: Request):
    st = get_state(request)
    st.check_model(body.model)
    plan, params = await prepare_chat(st, chat_request(body), _RENAME)
    mid = message_id()
    stream = await st.start_stream([plan.prompt_ids], params, mid, body.timeout, request)
    if body.stream:
        return SSEResponse(_events(mid, st.model_name, chat_deltas(plan, stream), stream), on_close=stream.close)
    last = await cancel_on_disconnect(request, run_chat(plan, stream))
    content = [_tool_use(c) for c in last.calls] if last.calls else [{"type": "text", "text": last.text}]
    reason, sequence = _stop(last)
    usage = usage_object(last.prompt_tokens, last.cached_tokens, last.completion_tokens)
    return message_object(mid, st.model_name, content, reason, sequence, usage)


def _event(kind: str, data: Dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _events(mid: str, model: str, deltas: AsyncIterator[Delta], stream: GenerationStream) -> AsyncIterator[str]:
    """message_start, ping, content blocks (text_delta / input_json_delta), message_delta, message_stop; an
    error after the headers is an `error` event."""
    try:
        first = stream.firsts[0]
        start_usage = usage_object(first.prompt_tokens, first.cached_tokens, 0)
        yield _event("message_start", {"message": message_object(mid, model, [], None, None, start_usage)})
        yield _event("ping", {})
        index, text_open = 0, False
        async for d in deltas:
            if d.text or (d.finish is not None and not d.calls and not text_open):
                if not text_open:
                    text_open = True
                    yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                if d.text:
                    yield _event(
                        "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": d.text}}
                    )
            if d.finish is None:
                continue
            if text_open:
                yield _event("content_block_stop", {"index": index})
                index += 1
            for call in d.calls:
                block = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": call.function.arguments}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
                index += 1
            reason, sequence = _stop(d)
            usage = usage_object(d.prompt_tokens, d.cached_tokens, d.completion_tokens)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
            yield _event("message_stop", {})
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        err = to_api_error(exc)
        yield _event("error", {"error": error_body(err.status, err.message)["error"]})
    finally:
        await stream.close()


@router.post(f"{PATH_PREFIX}/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Dict[str, int]:
    """The prompt's token count as /v1/messages would render it (chat template, tools)."""
    st = get_state(request)
    st.check_model(body.model)
    chat = chat_request(body)
    return {"input_tokens": len((await plan_chat(st, chat)).prompt_ids)}


class AnthropicErrorShape:
    """ASGI middleware: error responses (status >= 400) under /v1/messages get Anthropic's body instead
    of the OpenAI one every other layer writes; the status and the other headers stay."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        held: Dict[str, Any] = {}
        chunks: List[bytes] = []

        async def reshape(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"] = message
                return
            if "start" not in held or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held["start"]
            body = _anthropic_error(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, reshape)


def _anthropic_error(status: int, raw: bytes) -> bytes:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(error_body(status, str(message)), ensure_ascii=False).encode()
