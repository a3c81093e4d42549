"""ClusterArgs: every knob of `cluster.app:deployment`, validated before anything is deployed.

Sources: `serve run cluster.app:deployment key=value ...` (values arrive as strings; pydantic
coerces them), the `args:` of an application in a Serve config YAML (deploy/serve_config.yaml),
or Python (`deployment(ClusterArgs(workers=2))`). Unknown keys and bad values raise a
ValidationError naming the field, before any replica starts.

Engine options (page_size, max_total_tokens, dtype, device, ...) are generated from
engine.config.EngineConfig's fields and help texts, so the two never drift; each worker builds
its Engine from `engine_options()`. `enable_cache_events` is always on (the router needs it).

No `from __future__ import annotations` here: Serve applies the builder's pydantic annotation only
when it is a real class (docs/design.md).
"""

import dataclasses
import json
import os
import typing
from typing import Any, Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from engine.config import EngineConfig
from engine.errors import InvalidConfigError
from serving.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_TIMEOUT_S
from serving.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, StoreLimits

PolicyName = Literal["cache_aware", "round_robin", "power_of_two", "random", "prefix_hash"]
Mode = Literal["unified", "disaggregated"]
KVTransferName = Literal["nixl", "nccl"]
EventLoopName = Literal["auto", "asyncio", "uvloop"]
PoolName = Literal["unified", "prefill", "decode"]
"""The worker pools: `unified` in unified mode; `prefill` and `decode` in disaggregated mode."""


class PoolAutoscaling(BaseModel):
    """Autoscaling of one worker pool. The pool's replica count (`workers`, `prefill_workers` or
    `decode_workers`) is then the initial count; the cluster's control loop keeps the pool within
    [min_replicas, max_replicas], driven by the LLM signals below."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1, description="Fewest replicas of the pool.")
    max_replicas: int = Field(4, ge=1, description="Most replicas of the pool.")
    target_waiting_per_replica: float = Field(
        4.0, gt=0.0, description="Scale up when the pool's waiting requests per replica exceed this."
    )
    target_kv_usage: float = Field(
        0.8, gt=0.0, le=1.0, description="Scale up when the pool's mean KV-cache usage exceeds this share."
    )
    ttft_target_ms: Optional[float] = Field(
        None,
        gt=0.0,
        description="Scale up when the pool's recent p90 time to first token exceeds this (prefill and unified pools).",
    )
    itl_target_ms: Optional[float] = Field(
        None,
        gt=0.0,
        description="Scale up when the pool's recent p90 inter-token latency exceeds this (decode and unified pools).",
    )
    upscale_delay_s: float = Field(5.0, ge=0.0, description="A scale-up signal must hold this long first.")
    downscale_delay_s: float = Field(
        30.0, ge=0.0, description="The pool must be idle enough this long before one replica is removed."
    )

    @model_validator(mode="after")
    def _bounds(self) -> "PoolAutoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


_NOT_EXPOSED = {"model", "enable_cache_events", "skip_tokenizer_init", "detokenize", "profile_dir"}
"""EngineConfig fields set by the cluster itself: workers stream token ids (detokenize=False; the ingress
makes the text) and keep their tokenizer for structured output; profiling is the single-node server's
(POST /start_profile), not yet the cluster's."""


def default_ingress_replicas(cpus: float) -> int:
    """Ingress replicas when ClusterArgs.ingress_replicas is unset: one per 8 CPUs of the Ray cluster, 1 to 4.

    One replica is one Python event loop that writes every stream's events; at 64-256 streams in flight on
    one GPU it is CPU-bound (benchmarks/README.md, "Cluster front end"), while a 2-CPU machine has no
    second core to give it."""
    return max(1, min(4, int(cpus // 8)))


class _ClusterFields(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Optional[str] = Field(
        None,
        description="Hugging Face folder or .gguf file, readable on every worker node; default: SmolLM2-135M-Instruct.",
    )
    served_model_name: Optional[str] = Field(
        None, description="Model name clients send in requests; default: derived from `model`."
    )
    mode: Mode = Field(
        "unified",
        description="unified: every worker prefills and decodes; disaggregated: "
        "a prefill pool hands each prompt's KV cache to a decode pool.",
    )
    workers: int = Field(1, ge=1, description="Replicas in the unified worker pool (one engine each).")
    prefill_workers: int = Field(1, ge=1, description="disaggregated: replicas in the prefill pool.")
    decode_workers: int = Field(1, ge=1, description="disaggregated: replicas in the decode pool.")
    kv_transfer: KVTransferName = Field(
        "nixl",
        description="disaggregated: how KV pages move from prefill to "
        "decode replicas: nixl (UCX; GPU or host memory) or nccl (GPUs only).",
    )
    kv_transfer_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="disaggregated: a KV transfer not done "
        "in this time once its prompt is computed fails; pages are freed on both "
        "sides (the prompt's wait in the prefill queue is not counted).",
    )
    early_prefill: bool = Field(
        True,
        description="disaggregated: the ingress starts each prompt on its prefill "
        "replica when the request arrives, while the decode replica reserves pages for "
        "it; off: the decode replica starts it once its pages are reserved.",
    )
    autoscaling: Optional[PoolAutoscaling] = Field(
        None, description="Autoscaling of the unified pool (JSON object on the command line); off when unset."
    )
    prefill_autoscaling: Optional[PoolAutoscaling] = Field(
        None, description="Autoscaling of the prefill pool; off when unset."
    )
    decode_autoscaling: Optional[PoolAutoscaling] = Field(
        None, description="Autoscaling of the decode pool; off when unset."
    )
    policy: PolicyName = Field(
        "cache_aware",
        description="Router policy: cache_aware (SGLang's), round_robin, power_of_two, random, prefix_hash.",
    )
    cache_threshold: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="cache_aware: route to the best-matching worker "
        "when matched / prompt tokens exceeds this, else to the least loaded.",
    )
    balance_abs_threshold: float = Field(
        32.0,
        ge=0.0,
        description="cache_aware: the cluster is imbalanced when "
        "max load - min load exceeds this (and the relative test holds).",
    )
    balance_rel_threshold: float = Field(
        1.0001,
        ge=1.0,
        description="cache_aware: the cluster is imbalanced when "
        "max load > this * min load (and the absolute test holds).",
    )
    max_tree_tokens: Optional[int] = Field(
        1 << 20, ge=1, description="Size cap, in tokens, of the router's approximate tree of each worker."
    )
    prefix_hash_tokens: int = Field(256, ge=1, description="prefix_hash: leading tokens that pick the worker.")
    report_interval_s: float = Field(
        0.5,
        gt=0.0,
        le=10.0,
        description="How often the router polls each worker for queue length, KV usage and cache events.",
    )
    num_cpus: Optional[float] = Field(
        None,
        ge=0.0,
        description="CPUs reserved per worker replica (fractions "
        "allowed); default: 1, or an equal share of the Ray cluster's CPUs left by "
        "the ingress and the router when that is less (so the default pools start "
        "on a small machine).",
    )
    num_gpus: Optional[float] = Field(
        None,
        ge=0.0,
        description="GPUs per worker replica; default: tensor_parallel_size (one per rank) when the Ray cluster "
        "has GPUs, else 0.",
    )
    ingress_replicas: Optional[int] = Field(
        None,
        ge=1,
        description="Replicas of the HTTP ingress (stateless; the router deployment holds the routing state). "
        "Default: one per 8 CPUs of the Ray cluster, 1 to 4 (default_ingress_replicas): at high concurrency one "
        "ingress replica's event loop is the bottleneck.",
    )
    ingress_num_cpus: float = Field(0.25, ge=0.0, description="CPUs reserved per ingress replica.")
    ingress_event_loop: EventLoopName = Field(
        "auto",
        description="Event loop of each ingress replica. 'uvloop' (libuv) costs less per message: it serves "
        "more streams per second; but a busy uvloop accepts one new connection per turn, so requests on new "
        "connections wait in the kernel's accept queue. 'asyncio' (Python's own) accepts every pending "
        "connection at once. 'auto': uvloop when the workers have GPUs, else asyncio "
        "(docs/serving-path.md, 'Accepting connections').",
    )
    router_num_cpus: float = Field(0.1, ge=0.0, description="CPUs reserved by the router replica.")
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description="Concurrent requests one worker replica accepts (keep it high: the engine queues and batches).",
    )
    ingress_max_ongoing_requests: int = Field(
        512, ge=1, description="Concurrent HTTP requests one ingress replica accepts before Serve queues them."
    )
    api_key: Optional[str] = Field(
        None,
        description="When set, /v1/* and /generate need 'Authorization: Bearer "
        "<api_key>'. Default: $RADIXSERVE_API_KEY when set.",
    )
    admin_api_key: Optional[str] = Field(
        None,
        description="Key of the admin API (/admin/*) and the dashboard "
        "(/dashboard): 'Authorization: Bearer <admin_api_key>'. Must differ from "
        "api_key. Default: $RADIXSERVE_ADMIN_KEY when set; unset: admin "
        "routes answer 401.",
    )
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="Request bodies larger than this get a 413."
    )
    request_timeout_s: Optional[float] = Field(
        DEFAULT_REQUEST_TIMEOUT_S,
        gt=0.0,
        description="Default deadline of a request, queueing included (None: no default); a request's "
        "'timeout' may shorten it. Past it the request is aborted on its worker: a 504, or an error event.",
    )
    rate_limit_requests_per_minute: Optional[int] = Field(
        None,
        ge=1,
        description="Requests per minute per API key on the generating routes (429 beyond); each ingress "
        "replica enforces its share, this / ingress_replicas rounded up. None: no limit.",
    )
    rate_limit_tokens_per_minute: Optional[int] = Field(
        None,
        ge=1,
        description="Tokens per minute per API key, charged at admission as prompt tokens + max_tokens per "
        "choice (429 beyond); each ingress replica enforces this / ingress_replicas rounded up. None: no limit.",
    )
    cors_origins: Optional[str] = Field(
        None,
        description="Comma-separated browser origins allowed to call the API (CORS), or '*' for any. "
        "None: CORS off (no CORS headers; preflights get a 405).",
    )
    response_store_max_entries: int = Field(
        DEFAULT_MAX_ENTRIES,
        ge=0,
        description="Stored /v1/responses responses the router deployment keeps for GET and "
        "previous_response_id (least recently used go first). 0: store disabled (responses answer store=false).",
    )
    response_store_max_bytes: int = Field(
        DEFAULT_MAX_BYTES,
        ge=0,
        description="Bytes of stored responses' JSON the router deployment keeps at most (least recently used "
        "go first). 0: store disabled.",
    )
    worker_access_log: bool = Field(
        False,
        description="Log every call to a worker replica (generate, and the "
        "router's report polls several times a second).",
    )
    health_check_period_s: float = Field(
        2.0,
        gt=0.0,
        description="How often Serve checks each worker's health (a dead worker is replaced after a failed check).",
    )


def _engine_fields() -> Dict[str, Any]:
    """One pydantic field per EngineConfig field (type and help text copied; the default is the server's,
    serving.__main__.SERVER_DEFAULTS, where it differs from the library's)."""
    from serving.__main__ import SERVER_DEFAULTS

    hints = typing.get_type_hints(EngineConfig)
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_EXPOSED:
            continue
        default = SERVER_DEFAULTS.get(f.name, f.default)
        out[f.name] = (hints[f.name], Field(default, description=f"Engine: {f.metadata.get('help', f.name)}"))
    return out


ENGINE_OPTIONS = tuple(_engine_fields())


_UNIFIED_ONLY = ("workers", "autoscaling")
_DISAGGREGATED_ONLY = (
    "prefill_workers",
    "decode_workers",
    "kv_transfer",
    "kv_transfer_timeout_s",
    "early_prefill",
    "prefill_autoscaling",
    "decode_autoscaling",
)


KEY_ENV_VARS = {"api_key": "RADIXSERVE_API_KEY", "admin_api_key": "RADIXSERVE_ADMIN_KEY"}
"""Environment fallbacks of the two keys: Serve config args are literal, so Kubernetes Secrets reach
ClusterArgs as pod environment variables (helm/radixserve)."""


class _Validated(_ClusterFields):
    @model_validator(mode="before")
    @classmethod
    def _keys_from_env(cls, data: Any) -> Any:
        """api_key / admin_api_key not given (or null) are read from KEY_ENV_VARS when set and non-empty."""
        if isinstance(data, dict):
            for field, var in KEY_ENV_VARS.items():
                if data.get(field) is None and os.environ.get(var):
                    data = {**data, field: os.environ[var]}
        return data

    @field_validator("autoscaling", "prefill_autoscaling", "decode_autoscaling", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        """`serve run ... autoscaling='{"max_replicas": 4}'` passes a string."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"expected a JSON object: {exc}") from None
        return value

    @model_validator(mode="after")
    def _check_mode(self) -> "_Validated":
        wrong = _DISAGGREGATED_ONLY if self.mode == "unified" else _UNIFIED_ONLY
        given = sorted(set(wrong) & self.model_fields_set)
        if given:
            raise ValueError(f"{', '.join(given)} not used with mode={self.mode}")
        if self.mode == "disaggregated" and self._disaggregated_core_process() and self.tensor_parallel_size > 1:
            raise ValueError(
                "core_process with mode=disaggregated needs tensor_parallel_size 1: the other ranks' KV "
                "transfer runs beside a core in the worker's own process"
            )
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key must differ from api_key")
        return self

    def pool_sizes(self) -> Dict[str, int]:
        """Initial replicas of each pool of this mode: {pool name: replicas}."""
        if self.mode == "unified":
            return {"unified": self.workers}
        return {"prefill": self.prefill_workers, "decode": self.decode_workers}

    def pool_autoscaling(self, pool: str) -> Optional[PoolAutoscaling]:
        return {"unified": self.autoscaling, "prefill": self.prefill_autoscaling, "decode": self.decode_autoscaling}[
            pool
        ]

    @model_validator(mode="after")
    def _check_engine(self) -> "_Validated":
        try:
            EngineConfig.from_kwargs(model=self.model, enable_cache_events=True, **self.engine_options())
        except InvalidConfigError as exc:
            raise ValueError(f"invalid engine option: {exc}") from None
        from engine.models.source import resolve_model  # file checks only, no weights read

        for name in ("model", "tokenizer"):
            if getattr(self, name) is not None:
                try:
                    resolve_model(getattr(self, name))
                except Exception as exc:  # noqa: BLE001 - ModelNotFoundError and friends
                    raise ValueError(f"{name}: {exc}") from None
        return self

    def _disaggregated_core_process(self) -> bool:
        """Whether a disaggregated worker's engine core runs in a process of its own: only when asked for
        (core_process=true given), as its KV transfer then maps the core's pool into the worker's process."""
        return "core_process" in self.model_fields_set and self.core_process

    def engine_options(self) -> Dict[str, Any]:
        """EngineConfig keyword arguments of every worker (without model / enable_cache_events)."""
        options = {name: getattr(self, name) for name in ENGINE_OPTIONS}
        if self.mode == "disaggregated":
            # The KV transfer moves the pool's pages from the worker's process: with the core in a process of
            # its own, that pool is shared with the worker (EngineConfig.share_kv_pool).
            options["core_process"] = self._disaggregated_core_process()
            options["share_kv_pool"] = options["share_kv_pool"] or options["core_process"]
        return options

    def rate_limits(self, ingress_replicas: int) -> Any:
        """serving.ratelimit.RateLimits that each of `ingress_replicas` replicas enforces (its share)."""
        from serving.ratelimit import RateLimits

        limits = RateLimits(self.rate_limit_requests_per_minute, self.rate_limit_tokens_per_minute)
        return limits.share(ingress_replicas)

    def response_store_limits(self) -> StoreLimits:
        """Bounds of the router deployment's response store (cluster/ingress/response_store.py)."""
        return StoreLimits(self.response_store_max_entries, self.response_store_max_bytes)

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from serving.__main__ import default_model_name

        return default_model_name(self.model)


ClusterArgs = create_model(
    "ClusterArgs", __base__=_Validated, __doc__=__doc__.split("\n\n")[0], __module__=__name__, **_engine_fields()
)
