"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

    ResponsesRequest ──(previous_response_id: stored items + stored output, first)──▶ conversation items
        ──chat_request──▶ ChatCompletionRequest (instructions first as the system message, items as chat
        messages, function tools) ──chat_bridge──▶ the chat route's plan, engine stream and tool parsing
        ──▶ a Response object (message and function_call output items), or its stream events

A continued conversation renders as the earlier one did with the new items after it: with the same
`instructions` and tools, the earlier prompt's tokens are a prefix of the continued prompt's, so the
radix cache (and the cluster's cache-aware router) finds it. Stored responses live in the app's
ResponseStore (`app.state.response_store`, serving/response_store.py), their conversation as item
resources with ids (serving/response_items.py). When the store is disabled, a request with `store: true`
is answered as one with `store: false` (as vLLM does) and every lookup is a 404 that says so.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from pydantic import ValidationError

from serving.chat_bridge import Delta, chat_deltas, prepare_chat, run_chat
from serving.errors import APIError, bad_request, to_api_error
from serving.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, Tool, ToolCall
from serving.response_items import ItemListQuery, input_items_page, item_resources
from serving.response_store import STORE_DISABLED, ResponseStore, StoredResponse
from serving.responses_protocol import (
    UNSUPPORTED,
    ResponsesRequest,
    function_call_item,
    item_id,
    message_item,
    now,
    response_object,
    text_part,
    usage_object,
)
from serving.state import get_state
from serving.streams import GenerationStream, SSEResponse, cancel_on_disconnect

router = APIRouter()

_RENAME = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")


def _check_unsupported(body: ResponsesRequest) -> None:
    for name, why in UNSUPPORTED.items():
        if getattr(body, name) not in (None, False, [], 0):
            raise bad_request(why, name, "unsupported")
    if body.service_tier not in (None, "auto", "default"):
        raise bad_request(
            f"service_tier {body.service_tier!r} is not supported (auto or default)", "service_tier", "unsupported"
        )
    if body.truncation not in (None, "disabled"):
        raise bad_request("only truncation 'disabled' is supported", "truncation", "unsupported")


def _text(content: Any, param: str) -> str:
    """A message's or a function output's content as one string (text parts joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PART_TYPES:
            raise bad_request(
                f"content part type {kind!r} is not supported (text parts only)", f"{param}[{j}].type", "unsupported"
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request("a text part needs a string text", f"{param}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _field(item: Dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string", f"{param}.{name}")
    return value


def conversation_messages(items: List[Dict[str, Any]], instructions: Optional[str]) -> List[ChatMessage]:
    """Chat messages of Responses input items (`instructions` first, as a system message). Consecutive
    function_call items join the assistant message before them, as one turn's calls."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request("an input item must be an object", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"role must be user, assistant, system or developer, got {role!r}", f"{param}.role")
            messages.append(ChatMessage(role=role, content=_text(item.get("content"), f"{param}.content")))
        elif kind == "function_call":
            call = ToolCall(
                id=_field(item, "call_id", param),
                function=FunctionCall(name=_field(item, "name", param), arguments=_field(item, "arguments", param)),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{param}.output")
            messages.append(ChatMessage(role="tool", tool_call_id=_field(item, "call_id", param), content=output))
        else:
            raise bad_request(
                f"input item type {kind!r} is not supported (message, function_call, function_call_output)",
                f"{param}.type",
                "unsupported",
            )
    if not messages or all(m.role == "system" for m in messages):
        raise bad_request("input must contain at least one message", "input")
    return messages


def _tools(body: ResponsesRequest) -> Optional[List[Tool]]:
    if body.tools is None:
        return None
    tools = []
    for i, spec in enumerate(body.tools):
        kind = spec.get("type")
        if kind != "function":
            raise bad_request(
                f"tool type {kind!r} is not supported (function tools only)", f"tools[{i}].type", "unsupported"
            )
        fn = {k: spec[k] for k in ("name", "description", "parameters", "strict") if spec.get(k) is not None}
        try:
            tools.append(Tool.model_validate({"type": "function", "function": fn}))
        except ValidationError as exc:
            raise bad_request(f"invalid function tool: {exc.errors()[0]['msg']}", f"tools[{i}]") from exc
    return tools


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        "tool_choice",
        "unsupported",
    )


def _text_format(body: ResponsesRequest) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """(the format echoed in the response, the chat response_format)."""
    text = body.text or {}
    if text.get("verbosity") is not None:
        raise bad_request("text.verbosity is not supported", "text.verbosity", "unsupported")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return fmt, {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format.type must be text, json_object or json_schema", "text.format.type", "unsupported")


def chat_request(body: ResponsesRequest, items: List[Dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that answers `body` over the conversation `items`."""
    _, response_format = _text_format(body)
    return ChatCompletionRequest(
        model=body.model,
        messages=conversation_messages(items, body.instructions),
        tools=_tools(body),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        response_format=response_format,
        timeout=body.timeout,
    )


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


async def conversation_items(body: ResponsesRequest, store: ResponseStore) -> List[Dict[str, Any]]:
    """This turn's items: the stored conversation and output of previous_response_id, then `input`."""
    own = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if body.previous_response_id is None:
        return list(own)
    stored = await store.get(body.previous_response_id)
    if stored is None:
        why = STORE_DISABLED if not store.enabled else "never stored, deleted or evicted"
        raise APIError(
            404,
            f"previous response {body.previous_response_id!r} not found ({why})",
            "previous_response_id",
            "previous_response_not_found",
        )
    return [*stored["items"], *stored["response"]["output"], *own]


class _Answer:
    """Builds the output items of one response from chat deltas, and its stream events when streaming."""

    def __init__(self, rid: str, body: ResponsesRequest, model: str, text_format: Dict[str, Any]):
        self.rid, self.body, self.model, self.text_format = rid, body, model, text_format
        self.created_at = now()
        self.output: List[Dict[str, Any]] = []
        self.seq = 0
        self.message_id: Optional[str] = None
        self.text: List[str] = []

    def response(self, status: str, usage: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        return response_object(
            self.rid, self.body, self.model, self.created_at, status, list(self.output), usage, self.text_format
        )

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def open_message(self) -> List[str]:
        self.message_id = item_id("msg")
        index = len(self.output)
        return [
            self.event(
                "response.output_item.added", output_index=index, item=message_item(self.message_id, [], "in_progress")
            ),
            self.event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def text_delta(self, text: str) -> List[str]:
        events = self.open_message() if self.message_id is None else []
        self.text.append(text)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=len(self.output),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def close_message(self, status: str) -> List[str]:
        if self.message_id is None:
            return []
        text, index = "".join(self.text), len(self.output)
        item = message_item(self.message_id, [text_part(text)], status)
        where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        events = [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=text_part(text)),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return events

    def add_call(self, call: ToolCall) -> List[str]:
        fid, index = item_id("fc"), len(self.output)
        name, args = call.function.name, call.function.arguments
        done = function_call_item(fid, call.id, name, args, "completed")
        events = [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(fid, call.id, name, "", "in_progress"),
            ),
            self.event("response.function_call_arguments.delta", item_id=fid, output_index=index, delta=args),
            self.event(
                "response.function_call_arguments.done", item_id=fid, output_index=index, name=name, arguments=args
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]
        self.output.append(done)
        return events

    def finish(self, last: Delta) -> Tuple[List[str], str, Dict[str, Any]]:
        """Events closing the output, the final status and the usage, given the last delta."""
        status = "incomplete" if last.finish == "length" else "completed"
        if last.calls:
            events = self.close_message(status)
            for call in last.calls:
                events += self.add_call(call)
        else:
            events = self.open_message() if self.message_id is None else []  # an empty answer is an empty message
            events += self.close_message(status)
        return events, status, usage_object(last.prompt_tokens, last.cached_tokens, last.completion_tokens)


@router.post("/v1/responses", responses={200: {"content": {"text/event-stream": {}}}})
async def create_response(body: ResponsesRequest, request: Request):
    st = get_state(request)
    st.check_model(body.model)
    _check_unsupported(body)
    store = _store(request)
    if body.store and not store.enabled:
        body = body.model_copy(update={"store": False})
    items = await conversation_items(body, store)
    text_format, _ = _text_format(body)
    plan, params = await prepare_chat(st, chat_request(body, items), _RENAME)
    rid = item_id("resp")
    stream = await st.start_stream([plan.prompt_ids], params, rid, body.timeout, request)
    answer = _Answer(rid, body, st.model_name, text_format)

    async def keep(response: Dict[str, Any]) -> None:
        if body.store:
            await store.put(rid, {"response": response, "items": item_resources(items)})

    if body.stream:
        return SSEResponse(_events(answer, chat_deltas(plan, stream), stream, keep), on_close=stream.close)
    last = await cancel_on_disconnect(request, run_chat(plan, stream))
    if last.text:
        answer.text_delta(last.text)
    _, status, usage = answer.finish(last)
    response = answer.response(status, usage)
    await keep(response)
    return response


async def _events(
    answer: _Answer, deltas: AsyncIterator[Delta], stream: GenerationStream, keep: Any
) -> AsyncIterator[str]:
    """response.created … response.completed (or .incomplete); an error after the headers is an `error` event."""
    try:
        yield answer.event("response.created", response=answer.response("in_progress"))
        yield answer.event("response.in_progress", response=answer.response("in_progress"))
        async for d in deltas:
            if d.text:
                for e in answer.text_delta(d.text):
                    yield e
            if d.finish is not None:
                events, status, usage = answer.finish(d)
                for e in events:
                    yield e
                response = answer.response(status, usage)
                await keep(response)
                yield answer.event(f"response.{status}", response=response)
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        err = to_api_error(exc)
        yield answer.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        await stream.close()


async def _stored(request: Request, response_id: str) -> StoredResponse:
    store = _store(request)
    stored = await store.get(response_id)
    if stored is None:
        why = f" ({STORE_DISABLED})" if not store.enabled else ""
        raise APIError(404, f"response {response_id!r} not found{why}", "response_id", "not_found")
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Dict[str, Any]:
    return (await _stored(request, response_id))["response"]


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request) -> Dict[str, Any]:
    """OpenAI's ResponseItemList of the conversation the response answered (query: limit, order, after,
    before, include; serving/response_items.py)."""
    params = request.query_params
    query = ItemListQuery.parse(params, params.getlist("include[]") + params.getlist("include"))
    return input_items_page((await _stored(request, response_id))["items"], query)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Dict[str, Any]:
    store = _store(request)
    if not await store.delete(response_id):
        why = f" ({STORE_DISABLED})" if not store.enabled else ""
        raise APIError(404, f"response {response_id!r} not found{why}", "response_id", "not_found")
    return {"id": response_id, "object": "response", "deleted": True}
