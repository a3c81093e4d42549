"""serving.tool_calls without a model: prompt injection, call schema, parsing."""

from __future__ import annotations

import json

import jsonschema_rs

from serving import tool_calls as tc
from serving.protocol import NamedToolChoice, Tool

TOOLS = [
    Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ),
    Tool.model_validate({"type": "function", "function": {"name": "noop"}}),
]


def test_parse_plain_json_tagged_fenced_and_lists():
    for text in [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        ' <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
        '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',
    ]:
        calls = tc.parse_tool_calls(text, TOOLS)
        assert calls and calls[0].function.name == "get_weather", text
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert calls[0].id and calls[0].type == "function"
    two = tc.parse_tool_calls(
        '<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}</tool_call>',
        TOOLS,
    )
    assert [c.function.name for c in two] == ["noop", "get_weather"]


def test_parse_rejects_text_and_unknown_tools():
    for text in [
        "The weather is nice.",
        '{"name": "delete_all", "arguments": {}}',
        '{"name": "noop"',
        '{"name": "get_weather", "arguments": [1]}',
        "",
        "{}",
    ]:
        assert tc.parse_tool_calls(text, TOOLS) is None, text


def test_call_schema_accepts_exactly_valid_calls():
    schema = tc.call_schema(TOOLS)
    jsonschema_rs.validate(schema, {"name": "get_weather", "arguments": {"city": "Paris"}})
    jsonschema_rs.validate(schema, {"name": "noop", "arguments": {}})
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}, {"name": "noop"}):
        assert not jsonschema_rs.is_valid(schema, bad), bad
    named = tc.selected_tools(TOOLS, NamedToolChoice.model_validate({"function": {"name": "noop"}}))
    assert tc.call_schema(named)["properties"]["name"] == {"const": "noop"}


def test_inject_tools_into_system_prompt():
    msgs = tc.inject_tools([{"role": "user", "content": "hi"}], TOOLS, "auto")
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and msgs[1]["content"] == "hi"
    msgs = tc.inject_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS, "required"
    )
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.") and "noop" in msgs[0]["content"]


def test_may_become_tool_call():
    assert tc.may_become_tool_call("") and tc.may_become_tool_call(" {") and tc.may_become_tool_call("<tool")
    assert not tc.may_become_tool_call("Hello") and not tc.may_become_tool_call("<b>")
