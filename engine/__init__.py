"""engine: one replica's inference — no Ray, no HTTP.

Data flow and owners:

    Engine (engine.py)            validates and tokenizes in the caller's thread, runs the loop thread
      └─ Scheduler (scheduler/)   waiting queue (policy.py), prefill batches with chunking (prefill.py),
                                  decode with retraction (decode.py), outputs (output.py)
           ├─ KVCacheManager (memory/kv_cache_manager.py)  who owns which KV slot:
           │     ReqToTokenPool (request → slots), TokenToKVPoolAllocator (free pages), RadixCache (shared prefixes)
           └─ ModelRunner (runner/)  weights (models/), KVPool, attention backend (kernels/), Sampler

Public API: `from engine import Engine, SamplingParams`.
"""
from engine.errors import (EngineDeadError, EngineError, InvalidConfigError, InvalidRequestError,  # noqa: F401
                           ModelNotFoundError, OutOfMemoryError, PromptTooLongError, QueueFullError,
                           UnsupportedModelError)
from engine.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name):
    # Engine pulls in torch and transformers: import it lazily so `import engine` stays cheap.
    if name in ("Engine", "GenerateOutput", "StreamOutput"):
        from engine import engine as _engine
        return getattr(_engine, name)
    raise AttributeError(name)
