"""Schemathesis against the app's own OpenAPI document: no 5xx, no hang, no leaked KV pages.
Both valid (positive) and schema-violating (negative) requests are generated for every operation.

Requests are generated from the pydantic request models; before sending, `_cheap` keeps them
cheap (few tokens, few choices, the served model name) without narrowing the schema itself, so
the document stays OpenAI-compatible.
"""

from __future__ import annotations

import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

MAX_TOKENS, MAX_N, MAX_PROMPTS = 3, 2, 3


def _cheap(body):
    """Bound the work one generated request asks for."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
            body[key] = min(body[key], MAX_TOKENS)
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_TOKENS
    if "input" in body and body.get("max_output_tokens") is None:  # /v1/responses
        body["max_output_tokens"] = MAX_TOKENS
    if "prompt" in body and "max_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], MAX_N)
    for key in ("prompt", "text", "input_ids"):
        if isinstance(body.get(key), list) and body[key] and isinstance(body[key][0], (list, str)):
            body[key] = body[key][:MAX_PROMPTS]
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        sp = dict(sp)
        sp["max_new_tokens"] = (
            min(sp["max_new_tokens"], MAX_TOKENS)
            if isinstance(sp.get("max_new_tokens"), int) and not isinstance(sp.get("max_new_tokens"), bool)
            else MAX_TOKENS
        )
        if isinstance(sp.get("n"), int) and not isinstance(sp.get("n"), bool):
            sp["n"] = min(sp["n"], MAX_N)
        body["sampling_params"] = sp
    return body


def test_openapi_fuzz_no_server_errors(default_engine):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    from serving.app import build_app
    from serving.backend import EngineBackend

    app = build_app(EngineBackend(default_engine), model_name=MODEL)
    document = app.openapi()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/tokenize"):
        assert "requestBody" in document["paths"][path]["post"], path
    failures = []
    with serve(app) as url:
        schema = schemathesis.openapi.from_dict(document)
        operations = [r.ok() for r in schema.get_all_operations()]
        assert len(operations) >= 9
        cases = [
            (op, mode)
            for op in operations
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
        ]
        for op, mode in cases:

            @settings(
                max_examples=15,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                case.body = _cheap(case.body)
                response = case.call(base_url=url, timeout=60)
                own_deadline = isinstance(case.body, dict) and case.body.get("timeout") is not None
                if response.status_code == 504 and own_deadline:
                    return  # the documented answer to a request whose own `timeout` passed (e.g. 5e-324 s)
                if response.status_code >= 500:
                    failures.append((op.label, case.body, response.status_code, response.text[:300]))

            try:
                check()
            except Unsatisfiable:  # nothing to violate (no body, no parameters) in negative mode
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.label
    assert not failures, failures[:5]
    stats = wait_idle(default_engine)
    assert stats["running"] == 0
    assert_no_leak(default_engine)
