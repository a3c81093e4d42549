"""Per-API-key rate limits (serving/ratelimit.py): token buckets, the 429 body and headers over HTTP with
the real engine, and the `python -m serving` flags. The limiter's clock is a counter the test moves, so
nothing depends on how fast the machine is."""

from __future__ import annotations

import httpx
import pytest

from serving.ratelimit import RateLimits, TokenBucket, duration
from serving_harness import MODEL, serve


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_per_minute():
    clock = Clock()
    bucket = TokenBucket(120, clock)  # 2 per second
    assert bucket.take(120) and not bucket.take(1)
    assert bucket.wait_s(1) == pytest.approx(0.5) and bucket.wait_s(121) is None
    clock.now += 1.5
    assert bucket.take(3) and not bucket.take(1)
    clock.now += 3600
    assert bucket.take(120) and not bucket.take(1)  # full again, never above the capacity
    assert dict(bucket.headers("tokens")) == {
        "x-ratelimit-limit-tokens": "120",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m0s",
    }


@pytest.mark.parametrize("seconds,text", [(0.15, "150ms"), (1.25, "1.25s"), (12.4, "12s"), (360.0, "6m0s")])
def test_reset_duration_format(seconds, text):
    assert duration(seconds) == text


def test_limits_validate_and_share():
    with pytest.raises(ValueError, match="requests_per_minute"):
        RateLimits(requests_per_minute=0)
    assert not RateLimits().enabled
    assert RateLimits(100, 1001).share(3) == RateLimits(34, 334)
    assert RateLimits(None, 10).share(4) == RateLimits(None, 3)


@pytest.fixture(scope="module")
def limited(default_engine):
    """A server limited to 2 requests and 60 tokens per minute per key; its limiter's clock is the test's."""
    from serving.app import build_app
    from serving.backend import EngineBackend

    app = build_app(EngineBackend(default_engine), model_name=MODEL, rate_limits=RateLimits(2, 60))
    clock = app.state.rate_limiter.clock = Clock()
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, clock


def _post(client, key: str, path: str = "/v1/completions", **body) -> httpx.Response:
    if path == "/v1/chat/completions":
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}
    else:
        payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **body}
    return client.post(path, json=payload, headers={"Authorization": f"Bearer {key}"})


def _limited(r: httpx.Response, kind: str) -> dict:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == "rate_limit_exceeded" and err["param"] is None, err
    assert "Rate limit reached" in err["message"]
    return err


def test_requests_per_minute_per_key(limited):
    client, clock = limited
    first = _post(client, "key-a")
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-limit-tokens"] == "60"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 60
    stream = _post(client, "key-a", "/v1/chat/completions", stream=True)
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    assert stream.headers["x-ratelimit-remaining-requests"] == "0"
    refused = _post(client, "key-a", "/generate")  # /generate counts too (its body is invalid: 429 comes first)
    _limited(refused, "requests")
    assert refused.headers["retry-after"] == "30"  # 2 per minute: one more in 30 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert _post(client, "key-b").status_code == 200  # another key has its own budget
    assert client.get("/v1/models", headers={"Authorization": "Bearer key-a"}).status_code == 200  # not limited
    clock.now += 30
    assert _post(client, "key-a").status_code == 200


def test_tokens_per_minute_charge_prompt_and_max_tokens(limited):
    client, clock = limited
    big = _post(client, "key-c", max_tokens=61)
    err = _limited(big, "tokens")
    assert "request too large" in err["message"] and "retry-after" not in big.headers
    assert big.headers["x-ratelimit-remaining-requests"] == "2"  # a refused charge does not count the request
    ok = _post(client, "key-c", max_tokens=40, n=1)
    assert ok.status_code == 200, ok.text
    charged = 60 - int(ok.headers["x-ratelimit-remaining-tokens"])
    assert charged == ok.json()["usage"]["prompt_tokens"] + 40
    short = _post(client, "key-c", max_tokens=20, n=2)  # 2 choices: the prompt + 40
    _limited(short, "tokens")
    assert int(short.headers["retry-after"]) >= 1
    clock.now += 60
    assert _post(client, "key-c", max_tokens=20, n=2).status_code == 200


def test_key_check_comes_before_the_limit(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    app = build_app(EngineBackend(default_engine), model_name=MODEL, api_key="sk-k", rate_limits=RateLimits(1))
    app.state.rate_limiter.clock = Clock()
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert _post(client, "wrong").status_code == 401
        assert _post(client, "sk-k").status_code == 200  # the 401 spent nothing
        _limited(_post(client, "sk-k"), "requests")
        assert _post(client, "wrong").status_code == 401


def test_cli_flags():
    from serving.__main__ import build_parser, main

    args = build_parser().parse_args(["--rate-limit-requests-per-minute", "600", "--rate-limit-tokens-per-minute", "9"])
    assert (args.rate_limit_requests_per_minute, args.rate_limit_tokens_per_minute) == (600, 9)
    with pytest.raises(SystemExit) as exc:
        main(["--rate-limit-tokens-per-minute", "0"])  # refused before any model loads
    assert exc.value.code == 2
