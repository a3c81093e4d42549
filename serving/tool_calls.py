"""Function calling on top of a chat template: prompt, constraint, parsing.

tools ──render_tools / inject_tools──▶ the template's own `tools` rendering, or (templates that
    ignore `tools`, like the default model's) a system-prompt section asking for
    {"name": ..., "arguments": {...}}
tool_choice "required" / named ──call_schema──▶ SamplingParams.json_schema: anyOf over the
    tools, `name` as a const and `arguments` as the tool's parameter schema, so the output
    always parses to a valid call
output text ──parse_tool_calls──▶ [ToolCall] ("auto": only when it names a known tool)
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

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


def call_schema(tools: List[Tool]) -> Dict[str, Any]:
    """JSON schema of one call to any of `tools`."""
    variants = []
    for t in tools:
        params = t.function.parameters or {"type": "object"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


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


def parse_tool_calls(text: str, tools: List[Tool]) -> Optional[List[ToolCall]]:
    """The calls in `text` ({"name", "arguments"} JSON, a list of them, or <tool_call> blocks),
    or None unless every one parses and names a known tool."""
    known = {t.function.name for t in tools}
    calls: List[ToolCall] = []
    for chunk in _candidates(text):
        try:
            obj = json.loads(chunk)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item, known)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def may_become_tool_call(text: str) -> bool:
    """While streaming with tool_choice="auto": could `text` (so far) still be a tool call?"""
    head = text.lstrip()
    if not head:
        return True
    return head[0] in "{[`" or head.startswith("<tool_call>") or "<tool_call>".startswith(head)
