"""Function calling on top of a chat template: prompt, constraint, parsing.

tools ──render_tools / inject_tools──▶ the template's own `tools` rendering, or (templates that
    ignore `tools`, like the default model's) a system-prompt section asking for
    {"name": ..., "arguments": {...}}
tools + tool_choice + parallel_tool_calls ──forced_schema / strict_auto_grammar──▶ the grammar:
    "required" / named: SamplingParams.json_schema of one call ({"name": const, "arguments": the
        tool's parameters}, anyOf over the tools), or with "required" and parallel_tool_calls not
        false, of one call or a JSON array of one or more calls;
    "auto" with a `strict: true` tool: SamplingParams.lark, such calls or an answer (free text not
        starting with "{", "[" or whitespace; with a response_format, JSON matching it);
    "auto" otherwise: none (the output is parsed; calls are best effort).
    A strict tool's parameters are enforced exactly or the request is refused (400, param
    "tools"); a non-strict tool's are enforced when they can be exactly, else any object.
output text ──parse_tool_calls──▶ [ToolCall] ("auto": only when every call names a known tool)
A forced call cut by max_tokens is no call and no content (finish_reason "length", `content`
null): its text is half a wrapper, never the answer.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

from engine.errors import InvalidRequestError
from engine.runner.json_schema import JSON_COMPACT, json_schema_grammar
from serving.errors import APIError
from serving.protocol import FunctionCall, Tool, ToolCall

_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_PROBE_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool_zx9",
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
_renders_tools: Dict[int, bool] = {}


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts `tools` into the prompt (probed once per tokenizer)."""
    key = id(tokenizer)
    if key not in _renders_tools:
        messages = [{"role": "user", "content": "hi"}]
        try:
            with_tools = tokenizer.chat_prompt_text(messages, tools=_PROBE_TOOL)
            _renders_tools[key] = "probe_tool_zx9" in with_tools
        except Exception:  # noqa: BLE001 - a template that rejects tools does not render them
            _renders_tools[key] = False
    return _renders_tools[key]


def tool_prompt(tools: List[Tool], choice: Any) -> str:
    """The system-prompt section describing the tools, for templates without tool support."""
    specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    if choice == "auto":
        how = (
            "If one of these functions helps answer the user, reply with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>} and nothing else. '
            "Otherwise answer normally."
        )
    else:
        how = (
            'Reply with only a JSON object {"name": <function name>, "arguments": <arguments object>} '
            "calling one of these functions, and nothing else."
        )
    return f"You can call these functions:\n{specs}\n{how}"


def inject_tools(messages: List[Dict[str, Any]], tools: List[Tool], choice: Any) -> List[Dict[str, Any]]:
    """`messages` with the tool section appended to the system message (added when absent)."""
    section = tool_prompt(tools, choice)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{section}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def selected_tools(tools: List[Tool], choice: Any) -> List[Tool]:
    """The tools `choice` allows: all of them, or the one named (KeyError if unknown)."""
    if isinstance(choice, str):
        return tools
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise KeyError(choice.function.name)
    return named


def arguments_schema(tool: Tool, index: int) -> Dict[str, Any]:
    """The schema a call's `arguments` must match: the tool's parameters when they can be enforced
    exactly (a strict tool's must: 400 otherwise), else any object. Local "#/..." references keep
    resolving against the parameters once embedded (an "$id" of their own)."""
    params = tool.function.parameters or {"type": "object"}
    try:
        json_schema_grammar(params)
    except InvalidRequestError as exc:
        if tool.function.strict:
            msg = str(exc).replace("unsupported JSON schema: ", "")
            raise APIError(
                400,
                f"tool {tool.function.name!r} (strict): parameters use an unsupported feature: {msg}",
                "tools",
                "invalid_request",
            ) from exc
        return {"type": "object"}
    if "$id" in params or "id" in params:
        return params
    return {"$id": f"urn:radixserve:tool:{index}", **params}


def call_schema(tools: List[Tool], multiple: bool = False) -> Dict[str, Any]:
    """JSON schema of one call to any of `tools` (with `multiple`: or a non-empty array of calls)."""
    variants = []
    for i, t in enumerate(tools):
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": arguments_schema(t, i)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    one = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if not multiple:
        return one
    ref = {"$ref": "#/$defs/call"}
    return {"$defs": {"call": one}, "anyOf": [ref, {"type": "array", "items": ref, "minItems": 1}]}


def any_strict(tools: List[Tool]) -> bool:
    return any(t.function.strict for t in tools)


def forced_schema(tools: List[Tool], choice: Any, parallel: Optional[bool]) -> str:
    """SamplingParams.json_schema of a forced choice: one call of the named function, or with
    "required" one call to any of `tools` or (parallel_tool_calls not false) an array of calls."""
    return json.dumps(call_schema(tools, multiple=choice == "required" and parallel is not False))


def strict_auto_grammar(tools: List[Tool], parallel: Optional[bool], answer: Optional[Dict[str, Any]]) -> str:
    """SamplingParams.lark of "auto" with a strict tool: calls (JSON_COMPACT, as in `forced_schema`
    with "required"), or else the answer: free text that does not start like a call (nor with
    whitespace before one), or with `answer` (a response_format schema) a JSON value matching it."""
    compact = {"x-guidance": JSON_COMPACT}
    calls = {**compact, **call_schema(tools, multiple=parallel is not False)}
    if answer is None:
        rest = "TEXT\nTEXT: /[^{\\[ \\t\\r\\n][\\s\\S]*/"
    else:
        rest = f"answer\nanswer: %json {json.dumps({**compact, **answer})}"
    return f"start: calls | {rest}\ncalls: %json {json.dumps(calls)}\n"


def _candidates(text: str) -> List[str]:
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    tagged = _TOOL_CALL_TAG.findall(text)
    return tagged if tagged else [text]


def _as_call(obj: Any, known: set) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)))


def parse_tool_calls(
    text: str, tools: List[Tool], bare: bool = False, parallel: Optional[bool] = None
) -> Optional[List[ToolCall]]:
    """The calls in `text` ({"name", "arguments"} JSON, a list of them, or <tool_call> blocks),
    or None unless every one parses and names a known tool. `bare`: only `text` as a whole is
    JSON (the form a grammar enforces; fences and tags are text). `parallel` False: the first call."""
    known = {t.function.name for t in tools}
    calls: List[ToolCall] = []
    for chunk in [text] if bare else _candidates(text):
        try:
            obj = json.loads(chunk)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item, known)
            if call is None:
                return None
            calls.append(call)
    if parallel is False:
        calls = calls[:1]
    return calls or None


def is_cut_call(text: str, forced: bool, strict_auto: bool) -> bool:
    """Whether `text`, which did not parse as calls, is a call the grammar started (a forced call,
    or under a strict "auto" grammar, text that starts like one) rather than an answer."""
    return forced or (strict_auto and text[:1] in ("{", "["))


def may_become_tool_call(text: str) -> bool:
    """While streaming with tool_choice="auto": could `text` (so far) still be a tool call?"""
    head = text.lstrip()
    if not head:
        return True
    return head[0] in "{[`" or head.startswith("<tool_call>") or "<tool_call>".startswith(head)
