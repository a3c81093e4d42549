"""build_app: the FastAPI application over one ServingBackend.

Request path: ASGI middlewares (outermost first) answer CORS (`cors_origins`; off by default: no
CORS headers, OPTIONS preflights get a 405), count requests by route and status
(`_RequestMetrics`), check the API key on /v1/* and /generate (`_ApiKeyAuth`) and, when set, a
key's requests per minute (`RateLimit`, serving/ratelimit.py; its tokens are charged in
ServingState.start_stream), refuse a generation request at once, before its body is read, when the
app already holds as many as the backend admits (`AdmissionGate`, serving/admission.py) and reject
bodies over `max_body_bytes` with 413 (`_BodyLimit`, which buffers the body and replays it); then the routes
(openai_routes, generate_routes) translate to token ids and SamplingParams and stream from the
backend. The cluster ingress builds the same app over its own backend.
"""

from __future__ import annotations

import hmac
from typing import List, Optional, Sequence, Tuple

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving import anthropic, generate_routes, openai_routes, profile_routes, responses
from serving.admission import AdmissionGate
from serving.backend import ServingBackend
from serving.errors import error_response, install_error_handlers
from serving.lifetime import Lifetimes
from serving.metrics import Metrics
from serving.ratelimit import RateLimit, RateLimiter, RateLimits
from serving.response_store import LocalResponseStore, ResponseStore
from serving.state import ServingState

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Large enough for a prompt filling a 128K-token context as text or token ids (about 1 MB); a larger
body is refused from its Content-Length before it is read or parsed."""

DEFAULT_REQUEST_TIMEOUT_S = 600.0
"""Default deadline of a request, queueing included: what admission control lets wait is bounded
well below it, so it ends only what is stuck (a client that sends `timeout` may ask for less)."""


def build_app(
    backend: ServingBackend,
    *,
    api_key: Optional[str] = None,
    model_name: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    title: str = "radixserve",
    own_auth_prefixes: Tuple[str, ...] = (),
    response_store: Optional[ResponseStore] = None,
    request_timeout_s: Optional[float] = DEFAULT_REQUEST_TIMEOUT_S,
    rate_limits: Optional[RateLimits] = None,
    cors_origins: Sequence[str] = (),
) -> FastAPI:
    """The OpenAI-compatible app serving `backend` under `model_name`.

    `api_key`: when set, every route needs `Authorization: Bearer <api_key>` (401 otherwise) except
    /health and /metrics (OPEN_PATHS: probes and scrapers carry no key) and routes under
    `own_auth_prefixes`, which check a key of their own (the cluster's admin routes).
    `max_body_bytes`: larger bodies get a 413.
    `response_store`: where /v1/responses keeps stored responses (None: a LocalResponseStore of its own).
    `request_timeout_s`: the default deadline of every request, queueing included (None: none); a
    request's own `timeout` can only shorten it. `app.state.serving.lifetimes.drain(grace_s)` starts
    a drain (serving/lifetime.py).
    `rate_limits`: requests and tokens per minute per API key (serving/ratelimit.py); None: none.
    `cors_origins`: browser origins allowed to call the API (CORS; "*": any); empty: no CORS. Preflights
    answer before the key check (browsers send no key on them); credentials (cookies) are not allowed:
    the API key travels in the Authorization header.
    """
    app = FastAPI(
        title=title,
        version="0.1.0",
        description="OpenAI-compatible API (completions, chat completions, models, tokenize) "
        "and SGLang's native /generate.",
    )
    metrics = Metrics(model_name)
    app.state.serving = ServingState(
        backend=backend, model_name=model_name, metrics=metrics, lifetimes=Lifetimes(request_timeout_s)
    )
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(generate_routes.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.include_router(profile_routes.router)
    app.state.response_store = response_store if response_store is not None else LocalResponseStore()
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AdmissionGate, backend=backend)  # before a body is read: a burst's excess is refused first
    app.state.rate_limiter = None
    if rate_limits is not None and rate_limits.enabled:  # inside the key check: only known keys count
        app.state.rate_limiter = RateLimiter(rate_limits)
        app.add_middleware(RateLimit, limiter=app.state.rate_limiter)
    if api_key:
        app.add_middleware(_ApiKeyAuth, api_key=api_key, exempt_prefixes=own_auth_prefixes)
    app.add_middleware(anthropic.AnthropicErrorShape)  # outside every layer that may answer an error
    app.add_middleware(_RequestMetrics, metrics=metrics)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])
    return app


def parse_origins(text: Optional[str]) -> List[str]:
    """CORS origins from a comma-separated string ('https://a.example,https://b.example', or '*');
    None or '' → [] (CORS off)."""
    return [o.strip() for o in (text or "").split(",") if o.strip()]


OPEN_PATHS = ("/health", "/metrics")
"""Routes that answer without a key whatever is configured (liveness probes, Prometheus scrapes)."""


class _ApiKeyAuth:
    """`Authorization: Bearer <key>`, or `x-api-key: <key>` (what Anthropic's clients send)."""

    def __init__(self, app: ASGIApp, api_key: str, exempt_prefixes: Tuple[str, ...]):
        self.app, self.expected, self.exempt = app, f"Bearer {api_key}".encode(), exempt_prefixes
        self.expected_header = api_key.encode()

    def _protected(self, path: str) -> bool:
        return path not in OPEN_PATHS and not any(path.startswith(p) for p in self.exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._protected(scope["path"]):
            headers = dict(scope["headers"])
            given, given_header = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            bearer_ok = hmac.compare_digest(given, self.expected)
            if not (bearer_ok or hmac.compare_digest(given_header, self.expected_header)):
                resp = error_response(
                    401,
                    "invalid or missing API key (send Authorization: Bearer <key> or x-api-key: <key>)",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """Reads the whole request body (up to max_bytes), answers 413 beyond it, replays it otherwise."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(413, f"request body larger than {self.max_bytes} bytes", None, "body_too_large")
        await resp(scope, receive, send)


class _RequestMetrics:
    """Counts responses by route template and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(route=path, status=str(status["code"])).inc()
