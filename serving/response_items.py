"""A stored conversation as OpenAI item resources, and GET /v1/responses/{id}/input_items pages of it.

    conversation items (the request's input, after the stored items and output of previous_response_id)
        ──item_resources──▶ the items a stored response keeps: each with a unique `id`, a `status`, and a
        message's content as a list of text parts
        ──input_items_page(query)──▶ {"object": "list", "data", "first_id", "last_id", "has_more"}

`item_resources` changes no text: a message's string content becomes one text part (`input_text`, or
`output_text` for an assistant), which serving/responses.py renders as the same string, so a continued
conversation's prompt is unchanged. Ids given by the client are kept unless one repeats an earlier item's
(then the later item gets a new one), so every id names one item of a conversation and the cursors
`after` / `before` are unambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from serving.errors import APIError, bad_request
from serving.responses_protocol import item_id

DEFAULT_LIMIT = 20
MAX_LIMIT = 100

INCLUDE_NOTHING_TO_ADD = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
)
"""`include` values accepted on input_items: they add fields to items that are never stored (built-in
tools, images, reasoning are refused when a response is created), so the page is the same with them."""

INCLUDE_REFUSED = {
    "message.output_text.logprobs": "stored responses keep no logprobs",
}
"""`include` values that would add something this server does not keep: 400 naming `include`."""

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def item_resources(items: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """`items` (already validated: serving/responses.py conversation_messages) as item resources: new dicts,
    each with a unique `id` and a `status` ("completed" unless given); a message gets `type: "message"`
    and its content as text parts. Idempotent: resources pass through unchanged."""
    seen: set = set()
    out = []
    for item in items:
        kind = item.get("type", "message")
        resource = {**item, "type": kind}
        if not isinstance(resource.get("id"), str) or resource["id"] in seen:
            resource["id"] = item_id(_ID_PREFIX.get(kind, "item"))
        seen.add(resource["id"])
        resource.setdefault("status", "completed")
        if kind == "message":
            resource["content"] = _text_parts(resource.get("content"), resource.get("role"))
        out.append(resource)
    return out


def _text_parts(content: Any, role: Any) -> Any:
    """A message's content as a list of text parts (a string becomes one; "text" parts get their
    Responses type); other content is returned as it is."""
    kind = "output_text" if role == "assistant" else "input_text"
    extra = {"annotations": []} if kind == "output_text" else {}
    if isinstance(content, str):
        return [{"type": kind, "text": content, **extra}]
    if isinstance(content, list):
        return [{**extra, **part, "type": kind} if part.get("type") == "text" else part for part in content]
    return content


@dataclass(frozen=True)
class ItemListQuery:
    """The query of GET /v1/responses/{id}/input_items (OpenAI's): `limit` 1..100 (default 20), `order`
    "asc" | "desc" (default "desc": newest first), `after` / `before` item ids (exclusive cursors in that
    order), `include` values."""

    limit: int = DEFAULT_LIMIT
    order: str = "desc"
    after: Optional[str] = None
    before: Optional[str] = None
    include: tuple = ()

    @classmethod
    def parse(cls, params: Mapping[str, Any], include: List[str]) -> "ItemListQuery":
        """From the query string (`include` as sent: `include[]=…` or `include=…`, repeated); a bad value is a
        400 naming its parameter."""
        raw = params.get("limit")
        limit = DEFAULT_LIMIT
        if raw is not None:
            try:
                limit = int(raw)
            except ValueError:
                raise bad_request(f"limit must be an integer, got {raw!r}", "limit") from None
            if not 1 <= limit <= MAX_LIMIT:
                raise bad_request(f"limit must be between 1 and {MAX_LIMIT}, got {limit}", "limit")
        order = params.get("order") or "desc"
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
        for value in include:
            if value in INCLUDE_REFUSED:
                raise APIError(
                    400, f"include {value!r} is not supported: {INCLUDE_REFUSED[value]}", "include", "unsupported"
                )
            if value not in INCLUDE_NOTHING_TO_ADD:
                raise bad_request(f"include {value!r} is not a known value", "include")
        return cls(limit, order, params.get("after") or None, params.get("before") or None, tuple(include))


def input_items_page(items: List[Dict[str, Any]], query: ItemListQuery) -> Dict[str, Any]:
    """One page of a stored conversation's items (OpenAI's ResponseItemList). Items are taken in `order`,
    strictly between the `after` and `before` items; with `before` alone the page is the `limit` items just
    before it, otherwise the first `limit` after `after` (or from the start). `has_more`: more items lie
    beyond the page in the direction of paging. An empty page has null first_id / last_id. An `after` or
    `before` that names no item of the conversation is a 400."""
    ordered = items if query.order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for param, cursor in (("after", query.after), ("before", query.before)):
        if cursor is not None and cursor not in ids:
            raise bad_request(f"{param}: no item {cursor!r} in this response's input items", param)
    if query.after is not None:
        start = ids.index(query.after) + 1
    if query.before is not None:
        end = ids.index(query.before)
    window = ordered[start:end] if start < end else []
    backwards = query.before is not None and query.after is None
    page = window[-query.limit :] if backwards else window[: query.limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > len(page),
    }
