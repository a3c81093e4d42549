"""Regenerate openapi_subset.json from OpenAI's OpenAPI document (openai/openai-openapi, openapi.json).

    python tests/data/openai/trim_openapi.py PATH/TO/openapi.json COMMIT

Keeps the component schemas named in ROOTS and every schema they reference, without the keywords that
do not validate (descriptions, examples, x-* annotations), so the tests validate against the schemas
themselves. The document still uses OpenAPI 3.0's `nullable: true` in places, which JSON Schema
ignores; each such schema S becomes `{"anyOf": [S, {"type": "null"}]}`, what `nullable` means.
The README beside it names the commit the kept copy comes from.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, Iterator

ROOTS = [
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "ErrorResponse",
    "ListModelsResponse",
    "Model",
]
_DROP = {"description", "example", "examples", "title", "deprecated", "format"}
_PREFIX = "#/components/schemas/"


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                assert value.startswith(_PREFIX), value
                yield value[len(_PREFIX) :]
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _strip(node: Any, in_properties: bool = False) -> Any:
    """`node` without non-validating keywords (property names called 'description' are kept)."""
    if isinstance(node, list):
        return [_strip(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if not in_properties and (key in _DROP or key.startswith("x-") or key == "nullable"):
            continue
        out[key] = _strip(value, in_properties=key in ("properties", "$defs") and not in_properties)
    if not in_properties and node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def trim(document: Dict[str, Any]) -> Dict[str, Any]:
    schemas = document["components"]["schemas"]
    kept: Dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = _strip(schemas[name])
            todo.extend(_refs(schemas[name]))
    return {"openapi": document["openapi"], "components": {"schemas": dict(sorted(kept.items()))}}


if __name__ == "__main__":
    src, commit = sys.argv[1], sys.argv[2]
    with open(src) as f:
        subset = trim(json.load(f))
    subset["x-source"] = f"https://github.com/openai/openai-openapi/blob/{commit}/openapi.json"
    with open(__file__.replace("trim_openapi.py", "openapi_subset.json"), "w") as f:
        json.dump(subset, f, indent=1, sort_keys=False)
        f.write("\n")
