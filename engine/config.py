"""Engine configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from engine.errors import InvalidConfigError

LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
SchedulePolicy = Literal["lpm", "fcfs"]
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "torch_native")
FLASHINFER_PREFILL = ("auto", "paged-fa2", "paged-fa3", "ragged-fa2", "ragged-fa3")
"""kernels.attention.flashinfer.PREFILL_KINDS (config does not import the kernels; a test keeps them equal)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine replica.

    Capacity: the KV pool holds `max_total_tokens` token slots when given;
    otherwise `mem_fraction_static` of the device's memory (GPU: of total memory,
    minus weights and an activation reserve; CPU: of available RAM, capped at
    `cpu_max_total_tokens`) is used.
    """

    model: Optional[str] = field(
        default=None, metadata={"help": "HF folder, .gguf file, or None for the default model."}
    )
    load_format: LoadFormat = field(
        default="auto", metadata={"help": "How to read weights; 'dummy' = random weights, real shapes."}
    )
    dtype: str = field(
        default="auto", metadata={"help": "float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on GPU)."}
    )
    device: str = field(default="auto", metadata={"help": "cpu | cuda | cuda:N | auto."})
    page_size: int = field(default=1, metadata={"help": "Tokens per KV page."})
    max_total_tokens: Optional[int] = field(default=None, metadata={"help": "KV pool size in tokens."})
    mem_fraction_static: float = field(default=0.85, metadata={"help": "Memory fraction for weights + KV pool."})
    cpu_max_total_tokens: int = field(
        default=65536, metadata={"help": "Cap on the KV pool on CPU when sized from memory."}
    )
    max_running_requests: int = field(default=256, metadata={"help": "Max requests in the running batch."})
    max_queued_requests: Optional[int] = field(
        default=None,
        metadata={
            "help": (
                "Admission bound: requests beyond max_running_requests + this many in the engine (running "
                "and waiting) are refused with QueueFullError (HTTP 503 + Retry-After); None: unbounded."
            )
        },
    )
    chunked_prefill_size: int = field(
        default=2048, metadata={"help": "Max prompt tokens of one request per prefill step; -1 disables chunking."}
    )
    max_prefill_tokens: int = field(default=16384, metadata={"help": "Token budget of one prefill batch."})
    enable_mixed_chunk: bool = field(
        default=False,
        metadata={
            "help": (
                "A prefill step also decodes one token of every running request (SGLang's mixed chunked "
                "prefill); max_prefill_tokens counts them."
            )
        },
    )
    schedule_policy: SchedulePolicy = field(default="lpm", metadata={"help": "Waiting-queue order: lpm | fcfs."})
    disable_radix_cache: bool = field(default=False, metadata={"help": "Turn prefix caching off."})
    context_length: Optional[int] = field(default=None, metadata={"help": "Override the model's context length."})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": (
                "auto | flashinfer | triton | torch_native (auto: flashinfer on CUDA, else triton for "
                "float32; torch_native on CPU)."
            )
        },
    )
    disable_cuda_graph: bool = field(
        default=False, metadata={"help": "Run decode eagerly instead of replaying captured CUDA graphs (CUDA only)."}
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata={
            "help": (
                "Finish each batch before planning the next (default: launch batch N+1 before processing "
                "N's results). Same outputs."
            )
        },
    )
    disable_gemv: bool = field(
        default=False,
        metadata={"help": ("Every matmul with cuBLAS: none through our GEMV kernels (CUDA only; see gemv_max_rows).")},
    )
    gemv_max_rows: int = field(
        default=16,
        metadata={
            "help": (
                "bf16/fp16 matmuls of up to this many rows (decode steps of batches this small, and their"
                " logits) run our GEMV kernels on CUDA, larger ones cuBLAS; 1 = batch-1 steps only, at most 16."
            )
        },
    )
    cublaslt_max_rows: int = field(
        default=64,
        metadata={
            "help": (
                "bf16/fp16 matmuls of more rows than the GEMV kernels take and up to this many (decode steps of"
                " medium batches) take torch's cuBLASLt path on CUDA, whose kernels are faster there; 0: torch's"
                " default path for all of them."
            )
        },
    )
    triton_decode_max_bs: int = field(
        default=256,
        metadata={
            "help": (
                "With the FlashInfer attention backend (the bf16/fp16 default on CUDA), decode steps of up to this"
                " many requests (the batch rounded up to a power of two, as its CUDA graph) run the Triton decode"
                " kernels instead: they read the KV pool faster than FlashInfer's decode kernel, need no"
                " host-side plan per step, and take part in the GEMV kernels' PDL chain. Prefill, mixed and"
                " larger steps stay on FlashInfer. 0: FlashInfer for every step."
            )
        },
    )
    flashinfer_prefill: str = field(
        default="auto",
        metadata={
            "help": (
                "The prompt rows' attention kernel with the FlashInfer backend: auto | paged-fa2 | paged-fa3 |"
                " ragged-fa2 | ragged-fa3. paged: FlashInfer's paged prefill kernel over [cached prefix | new"
                " tokens] in the KV pool; ragged: its ragged kernel over the step's own K/V on steps without a"
                " cached prefix, the paged kernel on the others. fa2 / fa3: FlashInfer's kernel family (fa3:"
                " Hopper only). auto: ragged-fa3 on Hopper, paged-fa2 on other GPUs."
            )
        },
    )
    disable_pdl: bool = field(
        default=False,
        metadata={
            "help": "Launch our Triton kernels without programmatic dependent launch (Hopper and later; process-wide)."
        },
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata={
            "help": (
                "Tensor parallelism on CUDA: NCCL for every all-reduce instead of the peer-memory kernels for"
                " small ones (engine/parallel/allreduce.py)."
            )
        },
    )
    cuda_graph_max_bs: Optional[int] = field(
        default=None,
        metadata={
            "help": (
                "Largest decode batch captured as a CUDA graph (powers of two up to it). Default: "
                "max_running_requests, at most 256."
            )
        },
    )
    enable_piecewise_cuda_graph: bool = field(
        default=True,
        metadata={
            "help": (
                "Prefill and mixed steps of up to piecewise_cuda_graph_max_tokens tokens replay each layer's "
                "work outside attention from CUDA graphs, one set per token bucket, and run attention eagerly "
                "between them. CUDA with tensor_parallel_size 1 and CUDA graphs on; elsewhere those steps "
                "run eagerly."
            )
        },
    )
    piecewise_cuda_graph_max_tokens: int = field(
        default=2048,
        metadata={
            "help": (
                "Largest prefill or mixed step (tokens) that piecewise CUDA graphs run. Default: the servers' "
                "step budget (max_prefill_tokens 2048 there) and chunked_prefill_size, so that every step a "
                "server takes, a chunk with the running decodes beside it included, replays graphs."
            )
        },
    )
    tokenizer: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "Tokenizer source (HF folder or .gguf) when not the model's own, e.g. for dummy weights of a config."
            )
        },
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata={"help": "No tokenizer: prompts must be token ids and outputs carry no text."},
    )
    detokenize: bool = field(
        default=True,
        metadata={
            "help": (
                "Make text and check stop strings in the front end. False: token ids only; text is the "
                "caller's (engine.text)."
            )
        },
    )
    core_process: bool = field(
        default=False,
        metadata={
            "help": (
                "Run the scheduler and model (EngineCore) in a process of their own, over ZMQ (servers: "
                "on). False: a thread."
            )
        },
    )
    share_kv_pool: bool = field(
        default=False,
        metadata={
            "help": (
                "Allocate the KV pool so that another process of this machine can map it (Engine.kv_pool_rows"
                " with core_process): on CPU in a named shared-memory segment (/dev/shm); CUDA memory is"
                " shared through CUDA IPC. The cluster sets it for disaggregated workers whose core runs in a"
                " process of its own, so that their KV transfer moves the core's pages."
            )
        },
    )
    log_stats_interval_s: float = field(
        default=0.0,
        metadata={
            "help": (
                "Every this many seconds of work, log one line of throughput, queue, KV use and the longest step"
                " (engine/core/stats_log.py); 0: never. Servers default to 10."
            )
        },
    )
    warmup: bool = field(
        default=False,
        metadata={
            "help": (
                "CUDA: before taking requests, run three short requests (eager prefill and mixed steps, a cached"
                " prefix, sampling) so that kernels which compile on first use (FlashInfer's prefill module,"
                " Triton kernels of eager steps and sampling) compile at start-up, not in the first user's"
                " request; the cache and counters are then cleared (engine/core/warmup.py). Servers: on."
            )
        },
    )
    profile_dir: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "Folder for torch profiler traces of the scheduler's loop, recorded between"
                " Engine.start_profile and stop_profile (servers: POST /start_profile, /stop_profile);"
                " None: profiling is off."
            )
        },
    )
    enable_cache_events: bool = field(
        default=False,
        metadata={
            "help": "Record radix-cache insert/evict events for a router (drain them with Engine.drain_cache_events)."
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": (
                "Ranks one replica's model is split over (one process and one device each: cuda:N+rank, or the"
                " CPU over gloo), by attention head, MLP column and vocabulary row; 1: no tensor parallelism."
            )
        },
    )
    random_seed: int = field(default=0, metadata={"help": "Seed for dummy weights and unseeded sampling."})
    new_token_ratio: float = field(
        default=0.4, metadata={"help": "Share of max_new_tokens reserved when admitting a request."}
    )

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidConfigError(msg)

        check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        check(
            self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
            f"max_total_tokens must be >= page_size, got {self.max_total_tokens}",
        )
        check(
            0.0 < self.mem_fraction_static < 1.0,
            f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}",
        )
        check(self.max_running_requests >= 1, f"max_running_requests must be >= 1, got {self.max_running_requests}")
        check(
            self.max_queued_requests is None or self.max_queued_requests >= 0,
            f"max_queued_requests must be >= 0 or None, got {self.max_queued_requests}",
        )
        check(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
            f"chunked_prefill_size must be -1 or >= 1, got {self.chunked_prefill_size}",
        )
        check(self.log_stats_interval_s >= 0, f"log_stats_interval_s must be >= 0, got {self.log_stats_interval_s}")
        check(self.max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        check(
            self.schedule_policy in ("lpm", "fcfs"),
            f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}",
        )
        check(self.load_format in ("auto", "safetensors", "gguf", "dummy"), f"unknown load_format {self.load_format!r}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(
            self.context_length is None or self.context_length >= 2,
            f"context_length must be >= 2, got {self.context_length}",
        )
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        check(0 <= self.gemv_max_rows <= 16, f"gemv_max_rows must be in [0, 16], got {self.gemv_max_rows}")
        check(self.cublaslt_max_rows >= 0, f"cublaslt_max_rows must be >= 0, got {self.cublaslt_max_rows}")
        check(
            self.flashinfer_prefill in FLASHINFER_PREFILL,
            f"flashinfer_prefill must be one of {FLASHINFER_PREFILL}, got {self.flashinfer_prefill!r}",
        )
        check(self.triton_decode_max_bs >= 0, f"triton_decode_max_bs must be >= 0, got {self.triton_decode_max_bs}")
        check(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        check(
            self.piecewise_cuda_graph_max_tokens >= 8,
            f"piecewise_cuda_graph_max_tokens must be >= 8, got {self.piecewise_cuda_graph_max_tokens}",
        )
        check(
            self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
            f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}",
        )

    @property
    def admission_limit(self) -> Optional[int]:
        """Requests the engine holds at most (max_running_requests + max_queued_requests); None: unbounded."""
        if self.max_queued_requests is None:
            return None
        return self.max_running_requests + self.max_queued_requests

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments; unknown keys raise InvalidConfigError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
