"""Per-API-key rate limits: requests per minute and tokens per minute (optional, off by default).

    client ──▶ _ApiKeyAuth (401) ──▶ RateLimit middleware: 1 request from the key's request bucket,
               or 429 (type "requests") ──▶ route: validate, tokenize ──▶ ServingState.start_stream:
               prompt tokens + max_tokens × n charged to the key's token bucket, or 429 (type "tokens")

Each limited response (`LIMITED_PATHS`, 200 or 429) carries OpenAI's headers:
x-ratelimit-limit-requests / -remaining-requests / -reset-requests and the same for tokens (reset: the
time until the bucket is full again, "1.2s", "6m0s", "150ms"); a 429 also carries Retry-After (whole
seconds until the refused amount is available). The body is OpenAI's:
{"error": {"message", "type": "requests" | "tokens", "param": null, "code": "rate_limit_exceeded"}}.

Tokens are charged when the request is admitted, from what it may use: its prompt tokens plus
max_tokens for each choice (a request without max_tokens is charged the context it may fill). Nothing is
given back when a request ends early. A request larger than the whole per-minute token budget can never
pass: 429 without Retry-After.

The key is the bearer token the client sends (what _ApiKeyAuth checked when an api_key is set; without
one, whatever the client sends, and requests without an Authorization header share one bucket: then the
limits are per client-chosen name, not a security boundary). At most MAX_KEYS keys are tracked; beyond,
the least recently used is forgotten (it starts full again when it returns).

Why a module of its own rather than a library: none of the project's dependencies does rate limiting,
and what is needed is two token buckets per key (OpenAI's limits are "continuously replenished"), a few
dozen lines with no I/O, where a library (limits, slowapi, aiolimiter) would add a dependency and still
need the OpenAI headers and token charging written here.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.errors import APIError, error_response

LIMITED_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages")
"""Routes that generate: each request counts. Listing models, tokenize and detokenize are not limited."""

MAX_KEYS = 100_000

_SCOPE_KEY = "radixserve.rate_limit"


class TokenBucket:
    """`capacity` units, refilled continuously at capacity / 60 per second (a per-minute limit)."""

    def __init__(self, per_minute: int, clock: Callable[[], float]):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.level = self.capacity
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> bool:
        """Take `amount` when the bucket holds it (True); else take nothing (False)."""
        self._refill()
        if amount > self.level:
            return False
        self.level -= amount
        return True

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)

    def wait_s(self, amount: float) -> Optional[float]:
        """Seconds until `amount` is available; None when it never is (more than the capacity)."""
        if amount > self.capacity:
            return None
        self._refill()
        return max(0.0, (amount - self.level) / self.rate)

    def headers(self, kind: str) -> List[Tuple[str, str]]:
        self._refill()
        reset = (self.capacity - self.level) / self.rate
        return [
            (f"x-ratelimit-limit-{kind}", str(int(self.capacity))),
            (f"x-ratelimit-remaining-{kind}", str(int(self.level))),
            (f"x-ratelimit-reset-{kind}", duration(reset)),
        ]


def duration(seconds: float) -> str:
    """OpenAI's reset format: "150ms", "1.2s", "6m0s"."""
    if seconds < 1.0:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3g}s" if rest < 10 else f"{rest:.0f}s"
    return f"{int(minutes)}m{text}" if minutes else text


@dataclass(frozen=True)
class RateLimits:
    """Per key and per minute; None: that limit is off."""

    requests_per_minute: Optional[int] = None
    tokens_per_minute: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def share(self, replicas: int) -> "RateLimits":
        """What each of `replicas` servers enforces so that together they allow about these limits
        (each rounded up)."""
        return RateLimits(*(None if v is None else math.ceil(v / replicas) for v in self._values()))

    def _values(self) -> Tuple[Optional[int], Optional[int]]:
        return self.requests_per_minute, self.tokens_per_minute


class _KeyLimits:
    def __init__(self, limits: RateLimits, clock: Callable[[], float]):
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = None if rpm is None else TokenBucket(rpm, clock)
        self.tokens = None if tpm is None else TokenBucket(tpm, clock)

    def headers(self) -> List[Tuple[str, str]]:
        out: List[Tuple[str, str]] = []
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out += bucket.headers(kind)
        return out


class RateLimiter:
    """The buckets of every key (one event loop: not thread-safe)."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._keys: "collections.OrderedDict[str, _KeyLimits]" = collections.OrderedDict()

    def key(self, key: str) -> _KeyLimits:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyLimits(self.limits, self.clock)
            while len(self._keys) > MAX_KEYS:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        return state

    def take_request(self, key: str) -> None:
        """Count one request of `key`; raises the 429 when its request budget is spent."""
        bucket = self.key(key).requests
        if bucket is not None and not bucket.take(1):
            raise _limited("requests", f"requests per minute: limit {int(bucket.capacity)}", bucket.wait_s(1))

    def take_tokens(self, key: str, tokens: int) -> None:
        """Charge `tokens` to `key`; raises the 429 when its token budget cannot pay them now (the request
        it came with is then not counted)."""
        state = self.key(key)
        bucket = state.tokens
        if bucket is None or bucket.take(tokens):
            return
        if state.requests is not None:
            state.requests.give_back(1)
        wait = bucket.wait_s(tokens)
        limit = int(bucket.capacity)
        if wait is None:
            raise _limited(
                "tokens",
                f"request too large: {tokens} tokens (prompt + max_tokens per choice) exceed the limit of "
                f"{limit} tokens per minute; reduce the prompt or max_tokens",
                None,
            )
        raise _limited("tokens", f"tokens per minute: limit {limit}, requested {tokens}", wait)


def _limited(kind: str, what: str, wait_s: Optional[float]) -> APIError:
    retry = None if wait_s is None else max(1, math.ceil(wait_s))
    later = "" if retry is None else f" Please try again in {retry} s."
    return APIError(
        429, f"Rate limit reached on {what}.{later}", None, "rate_limit_exceeded", retry_after=retry, type=kind
    )


def charge_tokens(scope: Scope, tokens: int) -> None:
    """Charge a request's tokens to its key when rate limits apply to it (the middleware marked it)."""
    mark = scope.get(_SCOPE_KEY)
    if mark is not None:
        limiter, key = mark
        limiter.take_tokens(key, tokens)


class RateLimit:
    """ASGI middleware (inside the API-key check): counts each request to LIMITED_PATHS against its key,
    answers 429 when the key's request budget is spent, and adds the x-ratelimit-* headers to the
    response (after the route charged its tokens)."""

    def __init__(self, app: ASGIApp, limiter: RateLimiter):
        self.app, self.limiter = app, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization") or headers.get(b"x-api-key", b"")  # x-api-key: Anthropic's clients
        key = auth.decode("latin-1")
        key = key[len("Bearer ") :] if key.startswith("Bearer ") else key
        try:
            self.limiter.take_request(key)
        except APIError as err:
            headers: Dict[str, str] = dict(self.limiter.key(key).headers())
            headers.update(err.headers or {})
            await error_response(err.status, err.message, None, err.code, headers, type=err.type)(scope, receive, send)
            return
        scope[_SCOPE_KEY] = (self.limiter, key)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in self.limiter.key(key).headers()]
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        await self.app(scope, receive, send_with_headers)
