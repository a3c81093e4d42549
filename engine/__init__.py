"""engine: one replica's inference — no Ray, no HTTP.

Data flow and owners:

    Engine (engine.py)            front end: validates and tokenizes in the caller's thread, makes text
      │                           (text.py) and delivers outputs; reaches its EngineCore through core/
    EngineCore (core/)            the loop, in a thread or a process of its own (core_process)
      └─ Scheduler (scheduler/)   waiting queue (policy.py), prefill batches with chunking (prefill.py),
                                  decode with retraction (decode.py), outputs (output.py)
           ├─ KVCacheManager (memory/kv_cache_manager.py)  who owns which KV slot:
           │     ReqToTokenPool (request → slots), TokenToKVPoolAllocator (free pages), RadixCache (shared prefixes)
           └─ ModelRunner (runner/)  weights (models/), KVPool, attention backend (kernels/), Sampler;
                                     with tensor parallelism, rank 0 of a group (parallel/)

Public API: `from engine import Engine, SamplingParams`.
"""

from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,  # noqa: F401
    ModelNotFoundError,
    OutOfMemoryError,
    PromptTooLongError,
    QueueFullError,
    TensorParallelError,
    UnsupportedModelError,
)
from engine.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name):
    # Engine pulls in torch and transformers: import it lazily so `import engine` stays cheap.
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name in ("GenerateOutput", "StreamOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
