"""Servers shared by the serving test modules: the OpenAI app over the session's default engine (CPU).

Each fixture is module-scoped, so a module's teardown checks that its requests left no KV page behind; a
module that needs another app (keys, limits, CORS) defines its own fixture of the same name.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from engine_harness import assert_no_leak
from serving_harness import MODEL, serve


@pytest.fixture(scope="module")
def base_url(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
        yield url
    assert_no_leak(default_engine)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(default_engine):
    from serving.app import build_app
    from serving.backend import EngineBackend

    with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
        with httpx.Client(base_url=url, timeout=120) as c:
            yield c
    assert_no_leak(default_engine)
