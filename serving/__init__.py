"""serving: the HTTP front end (OpenAI protocol, FastAPI routes, metrics) and the single-node
server. Imports `engine`, never `ray`; the cluster ingress reuses `build_app` over its own backend.

Data flow and owners:

    HTTP ─▶ app.py           middlewares: request metrics, 413 body limit, 401 API key
         ─▶ openai_routes.py  /v1/models, /v1/tokenize, /v1/detokenize, and
              completions.py  /v1/completions   prompt(s) → ids
              chat.py         /v1/chat/completions  messages (+ tools, tool_calls.py) → chat template → ids
            generate_routes.py  SGLang /generate, /health, /metrics (metrics.py)
            responses.py    /v1/responses (+ GET/DELETE/input_items;        ┐ translated to a chat request,
                            response_store.py, response_items.py)          │
            anthropic.py    /v1/messages, /v1/messages/count_tokens        ┘ run by chat_bridge.py
         ─▶ state.py          model check, context check, OpenAI body → engine SamplingParams
              lifetime.py     each request's deadline (`timeout`, the server's default) and the drain
         ─▶ streams.py        GenerationStream: one backend stream per prompt, primed (rejections are
                              400/503 before any byte), merged; closed on finish/error/disconnect,
                              which aborts the request in the engine (its KV pages are freed)
         ─▶ backend.py        ServingBackend (ids in, StreamOutputs out): EngineBackend runs one
                              in-process engine.Engine; the cluster's ingress brings its own
         ◀─ chat_stream.py / completions.py: StreamOutputs → JSON or SSE chunks; protocol.py models

Tokenize once, here (docs/design.md): backends see token ids only. Errors leave as OpenAI error bodies
(errors.py), Anthropic's under /v1/messages (anthropic.AnthropicErrorShape). `python -m serving --model PATH`
runs the single-node server (__main__.py; server.py: uvicorn with a graceful drain on SIGTERM).
"""
