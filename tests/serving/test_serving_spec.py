"""Every response body and stream event of chat, completions, models and errors against OpenAI's
published schemas (tests/openai_spec.py): zero violations. Also the routes' edges a strict client
meets: unknown model → 404 model_not_found, malformed JSON, model ids with '/', /tokenize and
/detokenize at the root, CORS (off by default, configurable origins)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import httpx
import pytest
from fastapi.testclient import TestClient

from engine_harness import assert_no_leak
from openai_spec import COMPLETION_CHUNK, violations
from serving_harness import MODEL, serve

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_MSGS = [{"role": "user", "content": "What's the weather in Paris?"}]


def conforms(name: str, body: Any) -> Any:
    found = violations(name, body)
    assert not found, f"{name}: {found}\n{json.dumps(body)[:2000]}"
    return body


def events(http: httpx.Client, path: str, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The data events of a streamed request, [DONE] checked and left out."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def chat(**kw) -> Dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0, **kw}


def cmpl(**kw) -> Dict[str, Any]:
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, **kw}


CHAT_CASES: List[Tuple[str, Dict[str, Any]]] = [
    ("plain", chat()),
    ("n", chat(n=3, temperature=1.0, seed=3)),
    ("logprobs", chat(logprobs=True, top_logprobs=3)),
    ("stop", chat(stop=["Paris"], max_tokens=16)),
    ("json", chat(response_format={"type": "json_object"}, max_tokens=16)),
    ("tools_auto", chat(tools=[WEATHER], messages=WEATHER_MSGS, max_tokens=32)),
    ("tools_required", chat(tools=[WEATHER], tool_choice="required", messages=WEATHER_MSGS, max_tokens=32)),
    ("tools_logprobs", chat(tools=[WEATHER], tool_choice="required", logprobs=True, max_tokens=32)),
    ("length_zero", chat(max_tokens=0)),
]


@pytest.mark.parametrize("case, body", CHAT_CASES, ids=[c for c, _ in CHAT_CASES])
def test_chat_response_and_stream_conform(http, case, body):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    resp = conforms("CreateChatCompletionResponse", r.json())
    for choice in resp["choices"]:
        message = choice["message"]
        assert message["refusal"] is None
        assert "tool_calls" not in message or message["tool_calls"]  # absent, never null or empty
        if body.get("logprobs"):
            assert choice["logprobs"]["refusal"] is None
    if case == "tools_required":
        assert resp["choices"][0]["message"]["tool_calls"] and resp["choices"][0]["finish_reason"] == "tool_calls"
    chunks = events(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 0
    if body.get("logprobs") and "tools" not in body:  # a streamed tool call's chunks carry no logprobs
        with_lps = [c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"][0].get("logprobs")]
        assert with_lps and all(lp["refusal"] is None for lp in with_lps)
    plain = events(http, "/v1/chat/completions", body)  # without include_usage: no usage key at all
    assert all("usage" not in c for c in plain) and [conforms("CreateChatCompletionStreamResponse", c) for c in plain]


CMPL_CASES: List[Tuple[str, Dict[str, Any]]] = [
    ("plain", cmpl()),
    ("n_prompts", cmpl(prompt=["One, two,", "Hello"], n=2, temperature=1.0, seed=5)),
    ("logprobs", cmpl(logprobs=3)),
    ("echo", cmpl(echo=True)),
    ("stop", cmpl(prompt="1, 2, 3, 4,", stop=[" 6"], max_tokens=16)),
    ("token_ids", cmpl(prompt=[504, 3458, 282], logit_bias={"30": -100})),
]


@pytest.mark.parametrize("case, body", CMPL_CASES, ids=[c for c, _ in CMPL_CASES])
def test_completion_response_and_stream_conform(http, case, body):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    conforms("CreateCompletionResponse", r.json())
    chunks = events(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        conforms(COMPLETION_CHUNK, chunk)
    assert chunks[-1]["choices"] == [] and conforms("CompletionUsage", chunks[-1]["usage"])
    finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == len(r.json()["choices"])


def test_echo_with_logprobs_deviates_only_by_the_first_prompt_token(http):
    """echo + logprobs scores the prompt: its first token has no logprob, null as OpenAI's own API
    answers (lm-eval-harness reads it so); the published schema types these lists as numbers and
    objects only, and that entry is the one difference."""
    body = cmpl(echo=True, logprobs=2)
    found = violations("CreateCompletionResponse", http.post("/v1/completions", json=body).json())
    assert found and all(
        v.split(":")[0]
        in ("choices/0/logprobs/token_logprobs/0", "choices/0/logprobs/top_logprobs/0", "choices/0/logprobs")
        for v in found
    )


def test_models_conform_and_ids_with_slashes(http, default_engine):
    models = conforms("ListModelsResponse", http.get("/v1/models").json())
    assert [m["id"] for m in models["data"]] == [MODEL]
    conforms("Model", http.get(f"/v1/models/{MODEL}").json())
    from serving.app import build_app
    from serving.backend import EngineBackend

    org_model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with TestClient(build_app(EngineBackend(default_engine), model_name=org_model)) as c:
        card = conforms("Model", c.get(f"/v1/models/{org_model}").json())
        assert card["id"] == org_model
        err = conforms("ErrorResponse", c.get("/v1/models/HuggingFaceTB/other").json())
        assert err["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "method, path, body, status, param, code",
    [
        ("POST", "/v1/chat/completions", chat(model="gpt-4o"), 404, "model", "model_not_found"),
        ("POST", "/v1/completions", cmpl(model="gpt-4o"), 404, "model", "model_not_found"),
        ("GET", "/v1/models/gpt-4o", None, 404, "model", "model_not_found"),
        ("POST", "/tokenize", {"model": "gpt-4o", "prompt": "x"}, 404, "model", "model_not_found"),
        ("POST", "/v1/completions", b'{"model": "x", "prompt": [1, 2', 400, None, "invalid_request"),
        ("POST", "/v1/chat/completions", b"{not json", 400, None, "invalid_request"),
        ("POST", "/v1/completions", cmpl(temperature=5), 400, "temperature", "invalid_request"),
        ("POST", "/v1/completions", cmpl(logit_bias={"999999999": 1}), 400, "logit_bias", "invalid_request"),
        ("POST", "/v1/chat/completions", chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio", None),
        ("GET", "/v1/nope", None, 404, None, None),
    ],
)
def test_error_bodies_conform(http, method, path, body, status, param, code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {}
    r = http.request(method, path, json=body if isinstance(body, dict) else None, **kw)
    assert r.status_code == status, r.text
    err = conforms("ErrorResponse", r.json())["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code
    if isinstance(body, bytes):
        assert "JSON" in err["message"]


def test_tokenize_and_detokenize_at_the_root_and_under_v1(http, default_engine):
    tok = default_engine.tokenizer
    for prefix in ("", "/v1"):
        r = http.post(f"{prefix}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == default_engine.context_len
        chat_ids = http.post(f"{prefix}/tokenize", json={"messages": MSGS}).json()
        assert chat_ids["tokens"] == tok.apply_chat_template(MSGS, add_generation_prompt=True)
        back = http.post(f"{prefix}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
        assert back == {"prompt": "Hello world"}
        err = http.post(f"{prefix}/detokenize", json={"tokens": [-1]})
        assert err.status_code == 400 and err.json()["error"]["param"] == "tokens"
        err = http.post(f"{prefix}/tokenize", json={"prompt": "x", "messages": MSGS})
        assert err.status_code == 400 and conforms("ErrorResponse", err.json())


PREFLIGHT = {
    "Origin": "https://app.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_cors_off_by_default(http):
    r = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_with_configured_origins(default_engine):
    from serving.app import build_app, parse_origins
    from serving.backend import EngineBackend

    origins = parse_origins(" https://app.example , https://other.example")
    assert origins == ["https://app.example", "https://other.example"] and parse_origins(None) == []
    app = build_app(EngineBackend(default_engine), model_name=MODEL, api_key="k", cors_origins=origins)
    with TestClient(app) as c:
        r = c.options("/v1/chat/completions", headers=PREFLIGHT)  # a preflight carries no key
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
