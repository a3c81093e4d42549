"""`python -m serving --model PATH [--host H] [--port P] [--api-key K] [engine options]`:
one engine.Engine behind the OpenAI-compatible app, served by uvicorn (serving/server.py: SIGTERM
drains running requests before the process exits). This process runs HTTP, the
tokenizer, text and SSE; the Engine's core (scheduler, model, KV cache) runs in a process of its own
(--core-process, on by default here), so the two never wait for each other.

Engine options are generated from engine.config.EngineConfig's fields (their metadata 'help').
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import typing
from typing import Any, List, Optional

from engine.config import EngineConfig
from serving.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_TIMEOUT_S
from serving.ratelimit import RateLimits
from serving.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, LocalResponseStore, StoreLimits
from serving.server import DEFAULT_GRACE_S, DEFAULT_KEEP_ALIVE_S

_SERVER_FIELDS = {"model"}
SERVER_DEFAULTS = {
    "core_process": True,
    "enable_mixed_chunk": True,
    "max_prefill_tokens": 2048,
    "max_queued_requests": 128,
    "log_stats_interval_s": 10.0,
    "warmup": True,
}
"""Engine options whose server default differs from the library's (offline) one: a server runs its
scheduler in a process of its own, so that HTTP, text and SSE never stall a step; and it bounds the
latency of running requests while prompts arrive: each step carries their decode tokens beside the
prefill, within a budget of 2048 tokens per step (earlier first tokens than larger budgets, and no fewer
requests per second under load: benchmarks/README.md, "Step token budget"), where an offline batch
prefers larger prefill steps. A server also sheds load: beyond max_running_requests, at most 128 requests
wait (half a batch at the default 256), so an admitted request's wait stays bounded and the excess
gets a fast 503 with Retry-After; an offline batch queues everything. A server logs one line of
throughput, queue and KV use every 10 s of work, as vLLM's and SGLang's do, and on a GPU it warms its
kernels up before it answers, so that no user's request waits for a compiler. The cluster's workers use
the same (cluster/config.py)."""


def _field_type(f: dataclasses.Field) -> tuple:
    """(argparse type, choices, is_bool) of an EngineConfig field."""
    hints = typing.get_type_hints(EngineConfig)
    tp = hints[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), list(choices), False
    if tp is bool:
        return bool, None, True
    return (tp if tp in (int, float, str) else str), None, False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving", description="radixserve single-node OpenAI server")
    p.add_argument("--model", default=None, help="HF folder, .gguf file; default: SmolLM2-135M-Instruct.")
    p.add_argument("--served-model-name", default=None, help="Model name clients send (default: from --model).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("RADIXSERVE_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1/* and /generate (env RADIXSERVE_API_KEY).",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="Larger request bodies get 413.")
    p.add_argument(
        "--request-timeout-s",
        type=_positive_or_none,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="Default deadline of a request, queueing included ('none': no default); a request's "
        f"'timeout' may shorten it (default: {DEFAULT_REQUEST_TIMEOUT_S:g}).",
    )
    p.add_argument(
        "--graceful-shutdown-timeout-s",
        type=float,
        default=DEFAULT_GRACE_S,
        help="On SIGTERM / Ctrl-C: stop admitting, let running requests finish this long, then end "
        f"them with an error (default: {DEFAULT_GRACE_S:g}).",
    )
    p.add_argument(
        "--keep-alive-timeout-s",
        type=_non_negative_int,
        default=DEFAULT_KEEP_ALIVE_S,
        help="Close a keep-alive connection after this many idle seconds; keep it above the clients' own "
        f"idle expiry (httpx, openai: 5 s) so that they close first (default: {DEFAULT_KEEP_ALIVE_S}).",
    )
    p.add_argument(
        "--rate-limit-requests-per-minute",
        type=int,
        default=None,
        help="Requests per minute per API key on the generating routes; beyond, 429 (default: no limit).",
    )
    p.add_argument(
        "--rate-limit-tokens-per-minute",
        type=int,
        default=None,
        help="Tokens per minute per API key, charged at admission as prompt tokens + max_tokens per "
        "choice; beyond, 429 (default: no limit).",
    )
    p.add_argument(
        "--cors-origins",
        default=None,
        help="Comma-separated browser origins allowed to call the API (CORS), or '*' for any "
        "(default: none, CORS off).",
    )
    p.add_argument(
        "--response-store-max-entries",
        type=_non_negative_int,
        default=DEFAULT_MAX_ENTRIES,
        help="Responses kept for GET /v1/responses/{id} and previous_response_id (least recently used go "
        f"first); 0 disables the store: responses answer store=false (default: {DEFAULT_MAX_ENTRIES}).",
    )
    p.add_argument(
        "--response-store-max-bytes",
        type=_non_negative_int,
        default=DEFAULT_MAX_BYTES,
        help="Bytes of stored responses' JSON kept at most (least recently used go first); 0 disables the "
        f"store (default: {DEFAULT_MAX_BYTES}).",
    )
    p.add_argument("--log-level", default="info")
    group = p.add_argument_group("engine options (engine.config.EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SERVER_FIELDS:
            continue
        tp, choices, is_bool = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        default = SERVER_DEFAULTS.get(f.name, f.default)
        help_ = f"{f.metadata.get('help', '')} (default: {default})"
        if is_bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            group.add_argument(flag, dest=f.name, type=tp, choices=choices, default=default, help=help_)
    return p


def _positive_or_none(value: str) -> Optional[float]:
    if value.lower() == "none":
        return None
    seconds = float(value)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or 'none', got {value}")
    return seconds


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return number


def default_model_name(model: Optional[str]) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model))


def main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rate_limits = RateLimits(args.rate_limit_requests_per_minute, args.rate_limit_tokens_per_minute)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper())
    from engine import Engine
    from serving import server
    from serving.app import build_app, parse_origins
    from serving.backend import EngineBackend

    engine_opts: dict[str, Any] = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in _SERVER_FIELDS
    }
    engine = Engine(args.model, **engine_opts)
    app = build_app(
        EngineBackend(engine),
        api_key=args.api_key,
        model_name=args.served_model_name or default_model_name(args.model),
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout_s,
        rate_limits=rate_limits,
        cors_origins=parse_origins(args.cors_origins),
        response_store=LocalResponseStore(StoreLimits(args.response_store_max_entries, args.response_store_max_bytes)),
    )
    interrupted = False
    try:
        server.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            grace_s=args.graceful_shutdown_timeout_s,
            keep_alive_s=args.keep_alive_timeout_s,
            on_stopped=engine.shutdown,
        )
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it caught once the drain is over
        interrupted = True
    finally:
        engine.shutdown()
    if interrupted:  # end as SIGINT asks (status -SIGINT for a parent that waits), without a traceback
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    main()
