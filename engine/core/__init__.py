"""engine.core: the scheduler side of an Engine, and the two ways to reach it.

    Engine (engine.py, front end) ──messages.py──▶ CoreClient (client.py)
        ├─ ThreadCore (local.py):    EngineCore's loop in a thread of this process
        └─ ProcessCore (process.py): EngineCore alone in its own process (ZMQ, one message per step)
    EngineCore (core.py): ModelRunner + KV pools + RadixCache + Scheduler; loop = receive → step → send

The core never makes text and never talks to a client: it takes requests as token ids and returns
token ids, one StepOutputs message per scheduler step for every request with news.
"""
