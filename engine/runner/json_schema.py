"""JSON schema → llguidance grammar, exact or refused; the refusals in words a client can act on.

Contract: `json_schema_grammar(schema)` returns llguidance's grammar for `schema` (a string for
llguidance.LLMatcher) when every output it completes validates against `schema`, else raises
InvalidRequestError(param="json_schema") naming the keyword. It needs no tokenizer (a few ms),
so the HTTP layer can refuse a schema before a request reaches the engine; the engine then
compiles the same grammar against its tokenizer (engine/runner/grammar.py).

llguidance refuses what it cannot enforce on its own (`not`, `if`/`then`,
`dependencies`, `uniqueItems`, overlapping `oneOf`, remote `$ref`, unknown `format`, look-around
in `pattern`, ...); `check_schema` adds the ones it accepts but does not enforce exactly:

- `minProperties` above the number of `required` properties: the extra keys come from
  `additionalProperties` / `patternProperties`, whose keys llguidance does not keep unique, so
  `{"a": 1, "a": 2}` would count as two properties while a JSON parser keeps one.
- the top-level "x-guidance" options other than `whitespace_flexible` (separators and
  whitespace patterns could produce text that is not JSON; `lenient` would ignore keywords).

Objects are closed by default (`close_objects`): exact means every output validates, not that
every valid instance can be produced.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Iterator

from engine.errors import InvalidRequestError

X_GUIDANCE_ALLOWED = frozenset({"whitespace_flexible"})
JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""One line, one space after "," and ":" (Python's json.dumps): no runaway whitespace, and the
spacing small models are trained on (no space at all pushes them to odd tokens inside strings)."""
JSON_FLEXIBLE = {"whitespace_flexible": True}
"""Any JSON whitespace: only when a schema's top-level "x-guidance" sets "whitespace_flexible": true."""
JSON_OVERRIDES = {"lenient": False, "coerce_one_of": False}
"""Applied after "x-guidance": never ignore an unsupported keyword, never read oneOf as anyOf."""


def json_schema_grammar(schema: Any) -> str:
    """llguidance's grammar for `schema` (a parsed JSON schema, objects closed by `close_objects`);
    InvalidRequestError naming what would not be enforced exactly."""
    import llguidance  # noqa: PLC0415

    try:
        return _grammar(llguidance, schema)
    except RecursionError as exc:
        raise _refuse("the schema is nested too deeply") from exc


def _grammar(llguidance: Any, schema: Any) -> str:
    check_schema(schema)
    flexible = (schema.get("x-guidance") or {}).get("whitespace_flexible") is True
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        close_objects(schema), defaults=JSON_FLEXIBLE if flexible else JSON_COMPACT, overrides=JSON_OVERRIDES
    )
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise _refuse(explain(error))
    return grammar


def _refuse(msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"unsupported JSON schema: {msg}", param="json_schema")


def _subschemas(node: Any, path: str) -> Iterator[tuple]:
    """(path, dict) of every JSON object inside `node` (conservatively: each may be a schema)."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _subschemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _subschemas(value, f"{path}/{i}")


def check_schema(schema: Any) -> None:
    """Raise InvalidRequestError(param="json_schema") unless llguidance enforces `schema` exactly."""
    if not isinstance(schema, dict):
        raise _refuse(f"the schema must be a JSON object, got {type(schema).__name__}")
    options = schema.get("x-guidance")
    if options is not None:
        if not isinstance(options, dict):
            raise _refuse('"x-guidance" must be an object')
        for key, value in options.items():
            if key not in X_GUIDANCE_ALLOWED:
                raise _refuse(f'"x-guidance" option {key!r} (only "whitespace_flexible" may be set)')
            if not isinstance(value, bool):
                raise _refuse(f'"x-guidance".{key} must be a boolean')
    for path, node in _subschemas(schema, "#"):
        min_props = node.get("minProperties")
        required = node.get("required")
        n_required = len({r for r in required if isinstance(r, str)}) if isinstance(required, list) else 0
        if isinstance(min_props, int) and not isinstance(min_props, bool) and min_props > max(n_required, 1):
            raise _refuse(
                f"minProperties ({min_props}) above the number of required properties at {path} "
                "(keys of additional properties are not kept unique)"
            )


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "not", "contains", "if", "then", "else", "propertyNames")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of `schema` in which an object schema that lists `properties` and says nothing about
    other keys (no additionalProperties / patternProperties / unevaluatedProperties) allows no
    other keys, as in OpenAI's and xgrammar's strict modes. Every output stays valid for `schema`
    (it only narrows), and a small model cannot wander into inventing keys until max_tokens.
    Left as is: a schema that uses `allOf` anywhere (a closed branch would forbid the keys of the
    other branches), and an object that requires a key it does not list."""
    if "allOf" in json.dumps(schema):
        return schema
    return _close(schema)


def _close(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = [_close(sub) for sub in out[key]] if isinstance(out[key], list) else _close(out[key])
    props = out.get("properties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if (
        isinstance(props, dict)
        and not any(k in out for k in _OPEN_KEYS)
        and all(isinstance(r, str) and r in props for r in required)
    ):
        out["additionalProperties"] = False
    return out


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
_REMOTE = re.compile(r"Resource '([^']*)' is not present in a registry")


def explain(error: str) -> str:
    """llguidance's refusal of a schema, rewritten to name the keyword (first line only)."""
    first = error.strip().splitlines()[0] if error.strip() else "rejected"
    m = _UNIMPLEMENTED.search(first)
    if m:
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return f"unsupported keyword(s): {keys}"
    if first.startswith("oneOf constraints are not supported"):
        return "oneOf whose branches are not provably disjoint (an output could match several)"
    m = _REMOTE.search(first)
    if m:
        return f"$ref to a remote resource {m.group(1)!r} (only local '#/...' references)"
    if first.startswith("regex parse error"):
        detail = [ln for ln in error.splitlines() if ln.startswith("error:")]
        return f"pattern: {detail[0][len('error:') :].strip() if detail else first}"
    return first
