"""The server over raw HTTP (httpx): error statuses and bodies, SSE framing, auth, body limit,
queue full, /generate, tokenize, health, metrics, and client disconnects freeing KV pages."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve, wait_idle

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def base_url(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def secure_url(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    with serve(build_app(EngineBackend(default_engine), model_name=MODEL, api_key=KEY, max_body_bytes=4096)) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def cmpl(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


@pytest.mark.parametrize(
    "body,param",
    [
        (cmpl(logit_bias={"abc": 1}), "logit_bias"),
        (cmpl(logit_bias={"5": 101}), "logit_bias"),
        (chat(logit_bias={"5": "x"}), "logit_bias.5"),
        (cmpl(temperature=-1), "temperature"),
        (cmpl(temperature=3), "temperature"),
        (cmpl(top_p=0), "top_p"),
        (cmpl(n=0), "n"),
        (cmpl(max_tokens=-1), "max_tokens"),
        (cmpl(logprobs=21), "logprobs"),
        (cmpl(presence_penalty=5), "presence_penalty"),
        (cmpl(top_k=0), "top_k"),
        (cmpl(prompt=[]), "prompt"),
        (cmpl(prompt=""), "prompt"),
        (cmpl(prompt=[10**9]), "prompt"),
        (cmpl(prompt=[-1]), "prompt"),
        (cmpl(stop=[""]), "stop"),
        (cmpl(max_tokens=100000), "max_tokens"),
        (cmpl(prompt=None), "prompt"),
        (cmpl(regex="a", ebnf='root ::= "a"'), "json_schema"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), None),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
        (chat(tool_choice="required"), "tool_choice"),
        (
            chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "tool_choice",
        ),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(max_completion_tokens=10**6), "max_tokens"),
        (chat(response_format={"type": "json_schema"}), "response_format"),
        (chat(response_format={"type": "xml"}), None),
        # Limits on every input: the request is refused before it reaches the engine.
        (cmpl(n=129), "n"),
        (cmpl(seed=-1), "seed"),
        (cmpl(seed=2**70), "seed"),
        (cmpl(top_k=10**12), "top_k"),
        (cmpl(stop_token_ids=[10**12]), "stop_token_ids"),
        (cmpl(stop=[f"s{i}" for i in range(1000)]), "stop"),
        (cmpl(stop=["x" * 5000]), "stop"),
        (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]), "tools"),
        (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}]), "tools"),
    ],
)
def test_invalid_requests_are_400(http, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = assert_error(http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert http.post("/v1/completions", json=cmpl()).status_code == 200  # the server answers right after


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/v1/completions", b'{"model": "%s", "prompt": "a", "stop": ["\\udfff"]}', "stop"),
        ("/generate", b'{"text": "a\\ud800", "sampling_params": {"max_new_tokens": 2}}', "prompt"),
        ("/v1/completions", b'{"model": "%s", "prompt": "a", "repetition_penalty": Infinity}', "repetition_penalty"),
        ("/v1/completions", b'{"model": "%s", "prompt": "a", "temperature": NaN}', "temperature"),
        ("/generate", b'{"text": "a", "sampling_params": {"frequency_penalty": -Infinity}}', "frequency_penalty"),
    ],
)
def test_lone_surrogates_and_non_finite_numbers_are_400(http, path, raw, param):
    body = raw.replace(b"%s", MODEL.encode()) if b"%s" in raw else raw
    assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400, param)
    assert http.post("/v1/completions", json=cmpl()).status_code == 200


def test_context_overflow_message(http, default_engine):
    err = assert_error(http.post("/v1/completions", json=cmpl(max_tokens=default_engine.context_len)), 400)
    assert "maximum context length" in err["message"] and err["code"] == "context_length_exceeded"
    long_prompt = list(range(100, 100 + default_engine.context_len))
    err = assert_error(http.post("/v1/completions", json=cmpl(prompt=long_prompt)), 400, "prompt")
    assert "context length" in err["message"]


def test_malformed_bodies_are_400(http):
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", json=[1, 2]), 400)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"bogus": 1}}), 400, "bogus")
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"temperature": "hot"}}), 400)
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"n": 100000}}), 400, "n")
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"top_k": 10**12}}), 400, "top_k")
    assert http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert_error(http.post("/generate", json={}), 400)


def test_unknown_route_404_and_method_405(http):
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.post("/nope", json={}), 404)
    assert_error(http.get("/v1/models/other-model"), 404)
    assert http.get("/v1/completions").status_code == 405


def test_auth_and_body_limit(secure_url):
    with httpx.Client(base_url=secure_url, timeout=60) as c:
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.post("/generate", json={"text": "x"}), 401)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert_error(c.post("/v1/completions", headers=auth, json=cmpl(prompt="x" * 10000)), 413)
        # A chunked body (no Content-Length) over the limit is refused too.
        chunks = iter([b'{"model": "', b"x" * 5000, b'"}'])
        assert_error(c.post("/v1/completions", headers=auth, content=chunks), 413)
        r = c.post("/v1/completions", headers=auth, json=cmpl())
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_every_route_but_health_and_metrics_needs_the_key(secure_url):
    with httpx.Client(base_url=secure_url, timeout=60) as c:
        assert_error(c.get("/openapi.json"), 401)
        spec = c.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
        routes = [(m.upper(), p.replace("{model}", MODEL)) for p, ops in spec["paths"].items() for m in ops]
        assert ("POST", "/v1/completions") in routes and ("POST", "/generate") in routes
        for method, path in routes + [("GET", "/docs"), ("GET", "/nosuchroute")]:
            if path in ("/health", "/metrics"):
                assert c.request(method, path).status_code == 200
            elif path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's error shape
                r = c.request(method, path, json={})
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            else:
                assert_error(c.request(method, path, json={}), 401)


def test_queue_full_is_503_with_retry_after(base_url, default_engine):
    """One running slot, no queue: while a long stream holds the slot, the next request gets a 503
    with Retry-After at once; after it, requests are admitted again."""
    config = default_engine.config
    saved = config.max_running_requests, config.max_queued_requests
    object.__setattr__(config, "max_running_requests", 1)  # frozen dataclass; restored below
    object.__setattr__(config, "max_queued_requests", 0)
    try:
        with httpx.Client(base_url=base_url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=cmpl(**_long(stream=True))) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # kept referenced: a collected iterator closes the stream
                next(line for line in lines if line)  # running: it holds the one slot
                full = c.post("/v1/completions", json=cmpl())
                err = assert_error(full, 503)
                assert err["code"] == "queue_full" and full.headers["retry-after"] == "1"
                assert_error(c.post("/v1/chat/completions", json=chat(stream=True)), 503)
        wait_idle(default_engine)
    finally:
        object.__setattr__(config, "max_running_requests", saved[0])
        object.__setattr__(config, "max_queued_requests", saved[1])
    with httpx.Client(base_url=base_url, timeout=60) as c:
        assert c.post("/v1/completions", json=cmpl()).status_code == 200


def _sse_lines(response: httpx.Response) -> list:
    lines = [line for line in response.iter_lines()]
    events = [line for line in lines if line]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_sse_framing(http):
    with http.stream("POST", "/v1/completions", json=cmpl(stream=True, n=2)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse_lines(r)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert all(c["object"] == "text_completion" for c in chunks)
    usage = {"include_usage": True}
    with http.stream("POST", "/v1/chat/completions", json=chat(stream=True, stream_options=usage)) as r:
        chunks = _sse_lines(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    with http.stream(
        "POST", "/generate", json={"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    ) as r:
        chunks = _sse_lines(r)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["output_ids"]) == 4


def test_text_events_are_the_whole_chunk_encoded():
    """TextEvents (the per-token fast path of the completion and chat streams) gives exactly the characters
    `sse` gives for the whole chunk, for any text (escapes, non-ASCII, lone surrogates, the placeholder
    itself) and any choice index; a chunk that holds the placeholder elsewhere is encoded whole."""
    from hypothesis import given, settings, strategies as hs

    from serving.streams import _SLOT, TextEvents, sse

    def chunk(model):
        return lambda k, text: {"id": "cmpl-1", "model": model, "choices": [{"index": k, "text": text, "x": None}]}

    @settings(max_examples=300, deadline=None)
    @given(text=hs.text() | hs.sampled_from(['"\\\n', "\ud800", "é😀", _SLOT]), index=hs.integers(0, 3))
    def same(text, index):
        for model in ("m", "a" + _SLOT):
            assert TextEvents(chunk(model))(index, text) == sse(chunk(model)(index, text))

    same()
    events = TextEvents(chunk("m"))
    assert [events(0, "a"), events(1, "b"), events(0, "c")] == [
        sse(chunk("m")(k, t)) for k, t in ((0, "a"), (1, "b"), (0, "c"))
    ]


def test_generate_native(http, default_engine):
    ref = default_engine.generate("Hello", {"temperature": 0, "max_new_tokens": 6})
    r = http.post("/generate", json={"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == ref.text and out["output_ids"] == ref.token_ids
    assert out["meta_info"]["completion_tokens"] == 6
    ids = default_engine.tokenizer.encode("Hello")
    batch = http.post(
        "/generate",
        json={
            "input_ids": [ids, ids],
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6},
        },
    ).json()
    assert [b["text"] for b in batch] == [ref.text, ref.text]
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 6


def test_tokenize_detokenize_health_metrics(http, default_engine):
    tok = http.post("/v1/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tok["tokens"] == default_engine.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == default_engine.context_len
    chat_tok = http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["tokens"] == default_engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert http.post("/v1/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    assert_error(http.post("/v1/detokenize", json={"tokens": [-5]}), 400, "tokens")
    assert_error(http.post("/v1/tokenize", json={}), 400)
    assert http.get("/health").status_code == 200
    http.post("/v1/completions", json=cmpl())
    stats = wait_idle(default_engine)
    text = http.get("/metrics").text
    for name in (
        "radixserve_requests_total",
        "radixserve_prompt_tokens_total",
        "radixserve_generation_tokens_total",
        "radixserve_time_to_first_token_seconds_bucket",
        "radixserve_inter_token_latency_seconds_bucket",
        "radixserve_e2e_request_latency_seconds_bucket",
        "radixserve_num_requests_running",
        "radixserve_num_requests_waiting",
        "radixserve_kv_cache_usage_ratio",
        "radixserve_prefix_cache_hit_rate",
    ):
        assert name in text, name
    # The engine is idle: every KV slot is free or held by the prefix cache alone.
    kv = {
        kind: float(re.search(rf"^radixserve_kv_cache_{kind}_tokens{{[^}}]*}} (\S+)$", text, re.M).group(1))
        for kind in ("total", "free", "evictable")
    }
    assert kv == {"total": stats.kv_total_tokens, "free": stats.kv_free_tokens, "evictable": stats.kv_evictable_tokens}
    assert kv["evictable"] > 0 and kv["free"] + kv["evictable"] == kv["total"]
    assert 'route="/v1/completions",status="200"' in text and 'status="400"' in text


def _long(**kw):
    return {**kw, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


LONG_GENERATE = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", cmpl(**_long(stream=True, n=2))),
        ("/v1/chat/completions", chat(**_long(stream=True))),
        ("/generate", LONG_GENERATE),
    ],
)
def test_stream_disconnect_frees_pages(base_url, default_engine, path, body):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
    stats = wait_idle(default_engine)
    assert stats.running == 0 and stats.kv_free_tokens + stats.kv_evictable_tokens == stats.kv_total_tokens
    assert_no_leak(default_engine)


def test_non_stream_disconnect_frees_pages(base_url, default_engine):
    aborted = default_engine.stats().aborted
    with httpx.Client(base_url=base_url, timeout=1.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=cmpl(**_long()))
    stats = wait_idle(default_engine)
    assert stats.aborted > aborted
    assert_no_leak(default_engine)


def test_engine_error_types_map():
    from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
    from serving.errors import to_api_error

    assert to_api_error(InvalidRequestError("x", param="p")).status == 400
    assert to_api_error(QueueFullError("x")).status == 503
    assert to_api_error(EngineDeadError("x")).status == 503
