"""serving.tool_calls without a model: prompt injection, call schemas and grammars (compiled on the
default model's tokenizer and fed text token by token), parsing, cut calls."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from engine import SamplingParams
from engine.models.source import resolve_model
from engine.runner.grammar import GrammarCompiler, GrammarState
from engine.tokenizer import load_tokenizer
from serving import tool_calls as tc
from serving.errors import APIError
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


STRICT = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "set_unit",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
)
CALL = '{"name": "set_unit", "arguments": {"unit": "celsius"}}'


@pytest.fixture(scope="module")
def grammar():
    """accepts(params, text): whether the grammar of `params` takes `text` then EOS."""
    tok = load_tokenizer(resolve_model(None))
    compiler = GrammarCompiler(tok.hf, len(tok.hf), tok.eos_token_ids)

    def accepts(params: SamplingParams, text: str) -> bool:
        state = GrammarState(compiler.compile(params))
        ids = tok.hf.encode(text, add_special_tokens=False) + [min(tok.eos_token_ids)]
        return all(state.accept(t) for t in ids) and state.is_terminated()

    return accepts


def test_required_allows_several_calls_unless_parallel_is_false(grammar):
    tools = [TOOLS[0], STRICT]
    two = f'[{CALL}, {{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}]'
    many = SamplingParams(json_schema=tc.forced_schema(tools, "required", None))
    assert grammar(many, CALL) and grammar(many, two) and grammar(many, f"[{CALL}]")
    assert not grammar(many, "[]") and not grammar(many, '{"name": "set_unit", "arguments": {"unit": "kelvin"}}')
    one = SamplingParams(json_schema=tc.forced_schema(tools, "required", False))
    assert grammar(one, CALL) and not grammar(one, two)
    named = SamplingParams(json_schema=tc.forced_schema([STRICT], {"function": {"name": "set_unit"}}, None))
    assert grammar(named, CALL) and not grammar(named, f"[{CALL}]")
    assert [c.function.name for c in tc.parse_tool_calls(two, tools, bare=True)] == ["set_unit", "get_weather"]
    assert len(tc.parse_tool_calls(two, tools, bare=True, parallel=False)) == 1


def test_compact_calls(grammar):
    params = SamplingParams(json_schema=tc.forced_schema([STRICT], "required", None))
    assert grammar(params, CALL)
    assert not grammar(params, CALL.replace(": ", ":")) and not grammar(params, CALL.replace(", ", ",\n  "))


def test_strict_tool_under_auto_allows_text_or_a_strict_call(grammar):
    params = SamplingParams(lark=tc.strict_auto_grammar([TOOLS[0], STRICT], None, None))
    assert grammar(params, CALL) and grammar(params, f"[{CALL}, {CALL}]")
    assert grammar(params, "It is sunny in Paris {really}.")
    assert not grammar(params, '{"name": "set_unit", "arguments": {"unit": "kelvin"}}')  # strict arguments
    assert not grammar(params, ' {"name":"set_unit","arguments":{}}')  # no text that starts like a call
    assert not grammar(params, '{"answer": "free JSON"}')
    assert grammar(params, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not grammar(params, '{"name": "get_weather", "arguments": {"town": 1}}')  # enforced where it can be
    one = SamplingParams(lark=tc.strict_auto_grammar([STRICT], False, None))
    assert grammar(one, CALL) and not grammar(one, f"[{CALL}]")
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    with_format = SamplingParams(lark=tc.strict_auto_grammar([STRICT], None, answer))
    assert grammar(with_format, CALL) and grammar(with_format, '{"ok": true}')
    assert not grammar(with_format, "plain text") and not grammar(with_format, '{"ok": 1}')


def test_strict_parameters_are_enforced_or_refused():
    bad = Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "f",
                "strict": True,
                "parameters": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
            },
        }
    )
    with pytest.raises(APIError) as err:
        tc.forced_schema([bad], "required", None)
    assert err.value.status == 400 and err.value.param == "tools" and "not" in err.value.message
    loose = Tool.model_validate({"type": "function", "function": {**bad.function.model_dump(), "strict": None}})
    assert tc.call_schema([loose])["properties"]["arguments"] == {"type": "object"}  # best effort: any object


def test_local_refs_resolve_inside_arguments(grammar):
    tool = Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "g",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"n": {"$ref": "#/$defs/small"}},
                    "required": ["n"],
                    "$defs": {"small": {"type": "integer", "maximum": 9}},
                },
            },
        }
    )
    params = SamplingParams(json_schema=tc.forced_schema([tool], "required", False))
    assert grammar(params, '{"name": "g", "arguments": {"n": 3}}') and not grammar(
        params, '{"name": "g", "arguments": {"n": 12}}'
    )


def test_cut_calls():
    assert tc.is_cut_call('{"name": "get_wea', forced=True, strict_auto=False)
    assert tc.is_cut_call('{"name": "get_wea', forced=False, strict_auto=True)
    assert not tc.is_cut_call("Hello", forced=False, strict_auto=True)
    assert not tc.is_cut_call('{"name": "get_wea', forced=False, strict_auto=False)
