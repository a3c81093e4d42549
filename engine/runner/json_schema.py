"""JSON-schema checks llguidance does not make itself, and its refusals in words a client can act on.

Contract: `check_schema(schema)` returns None when llguidance's grammar for `schema` is exact
(every output that completes validates), else raises InvalidRequestError(param="json_schema")
naming the keyword. llguidance refuses what it cannot enforce on its own (`not`, `if`/`then`,
`dependencies`, `uniqueItems`, overlapping `oneOf`, remote `$ref`, unknown `format`, look-around
in `pattern`, ...); the cases here are the ones it accepts but does not enforce exactly:

- `minProperties` above the number of `required` properties: the extra keys come from
  `additionalProperties` / `patternProperties`, whose keys llguidance does not keep unique, so
  `{"a": 1, "a": 2}` would count as two properties while a JSON parser keeps one.
- the top-level "x-guidance" options other than `whitespace_flexible` (separators and
  whitespace patterns could produce text that is not JSON; `lenient` would ignore keywords).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from engine.errors import InvalidRequestError

X_GUIDANCE_ALLOWED = frozenset({"whitespace_flexible"})


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
        n_required = len(set(required)) if isinstance(required, list) else 0
        if isinstance(min_props, int) and not isinstance(min_props, bool) and min_props > max(n_required, 1):
            raise _refuse(
                f"minProperties ({min_props}) above the number of required properties at {path} "
                "(keys of additional properties are not kept unique)"
            )


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
