"""OpenAI's published schemas (tests/data/openai/openapi_subset.json, trimmed from openai/openai-openapi)
as jsonschema validators, and the request parameters they document.

`violations(name, body)` lists every way `body` breaks component schema `name` (empty: conforms).
Streamed completions have no schema of their own in the document (its /completions answers only
application/json); their chunks are checked against CreateCompletionResponse with one relaxation,
`finish_reason: null` before a choice's last chunk, as OpenAI's own stream sends it
(COMPLETION_CHUNK).
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
from typing import Any, Dict, List

import jsonschema

SUBSET = pathlib.Path(__file__).parent / "data" / "openai" / "openapi_subset.json"
COMPLETION_CHUNK = "CompletionChunk"


@functools.lru_cache(maxsize=1)
def document() -> Dict[str, Any]:
    return json.loads(SUBSET.read_text())


def _schema(name: str) -> Dict[str, Any]:
    doc = document()
    if name != COMPLETION_CHUNK:
        return {**doc, "$ref": f"#/components/schemas/{name}"}
    doc = copy.deepcopy(doc)
    chunk = doc["components"]["schemas"]["CreateCompletionResponse"]
    finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [finish, {"type": "null"}]}
    return {**doc, "$ref": "#/components/schemas/CreateCompletionResponse"}


@functools.lru_cache(maxsize=None)
def validator(name: str) -> jsonschema.protocols.Validator:
    schema = _schema(name)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def violations(name: str, body: Any) -> List[str]:
    """Every violation of schema `name` by `body`, as 'path: message' (empty when it conforms)."""
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator(name).iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    ]


def request_parameters(name: str) -> Dict[str, Any]:
    """The documented properties of request schema `name` (allOf parts merged): name → schema."""
    schemas = document()["components"]["schemas"]

    def collect(schema: Dict[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for part in schema.get("allOf", [schema]):
            if "$ref" in part:
                out.update(collect(schemas[part["$ref"].rsplit("/", 1)[1]]))
            else:
                out.update(part.get("properties", {}))
        return out

    return collect(schemas[name])
