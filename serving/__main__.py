"""`python -m serving --model PATH [--host H] [--port P] [--api-key K] [engine options]`:
one in-process engine.Engine behind the OpenAI-compatible app, served by uvicorn.

Engine options are generated from engine.config.EngineConfig's fields (their metadata 'help').
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import typing
from typing import Any, List, Optional

from engine.config import EngineConfig

_SERVER_FIELDS = {"model"}


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
    p.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on /v1/* and /generate (env RADIXSERVE_API_KEY).")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="Larger request bodies get 413.")
    p.add_argument("--log-level", default="info")
    group = p.add_argument_group("engine options (engine.config.EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SERVER_FIELDS:
            continue
        tp, choices, is_bool = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{f.metadata.get('help', '')} (default: {f.default})"
        if is_bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_)
        else:
            group.add_argument(flag, dest=f.name, type=tp, choices=choices, default=f.default, help=help_)
    return p


def default_model_name(model: Optional[str]) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model))


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    import uvicorn

    from engine import Engine
    from serving.app import build_app
    from serving.backend import EngineBackend

    engine_opts: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                                   if f.name not in _SERVER_FIELDS}
    engine = Engine(args.model, **engine_opts)
    app = build_app(EngineBackend(engine), api_key=args.api_key, model_name=args.served_model_name or
                    default_model_name(args.model), max_body_bytes=args.max_body_bytes)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
