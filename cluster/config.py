"""ClusterArgs: every knob of `cluster.app:deployment`, validated before anything is deployed.

Sources: `serve run cluster.app:deployment key=value ...` (values arrive as strings; pydantic
coerces them), the `args:` of an application in a Serve config YAML (deploy/serve_config.yaml),
or Python (`deployment(ClusterArgs(workers=2))`). Unknown keys and bad values raise a
ValidationError naming the field, before any replica starts.

Engine options (page_size, max_total_tokens, dtype, device, ...) are generated from
engine.config.EngineConfig's fields and help texts, so the two never drift; each worker builds
its Engine from `engine_options()`. `enable_cache_events` is always on (the router needs it).

No `from __future__ import annotations` here: Serve applies the builder's pydantic annotation only
when it is a real class (RAY_SERVE_NOTES §6).
"""
import dataclasses
import typing
from typing import Any, Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from engine.config import EngineConfig
from engine.errors import InvalidConfigError

PolicyName = Literal["cache_aware", "round_robin", "power_of_two", "random", "prefix_hash"]

_NOT_EXPOSED = {"model", "enable_cache_events", "skip_tokenizer_init"}
"""EngineConfig fields set by the cluster itself (workers detokenize, so they keep a tokenizer)."""


class _ClusterFields(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Optional[str] = Field(None, description="Hugging Face folder or .gguf file, readable on every worker "
                                                   "node; default: SmolLM2-135M-Instruct.")
    served_model_name: Optional[str] = Field(None, description="Model name clients send in requests; default: "
                                                               "derived from `model`.")
    workers: int = Field(1, ge=1, description="Replicas in the unified worker pool (one engine each).")
    policy: PolicyName = Field("cache_aware", description="Router policy: cache_aware (SGLang's), round_robin, "
                                                          "power_of_two, random, prefix_hash.")
    cache_threshold: float = Field(0.5, ge=0.0, le=1.0, description="cache_aware: route to the best-matching worker "
                                   "when matched / prompt tokens exceeds this, else to the least loaded.")
    balance_abs_threshold: float = Field(32.0, ge=0.0, description="cache_aware: the cluster is imbalanced when "
                                         "max load - min load exceeds this (and the relative test holds).")
    balance_rel_threshold: float = Field(1.0001, ge=1.0, description="cache_aware: the cluster is imbalanced when "
                                         "max load > this * min load (and the absolute test holds).")
    max_tree_tokens: Optional[int] = Field(1 << 20, ge=1, description="Size cap, in tokens, of the router's "
                                           "approximate tree of each worker.")
    prefix_hash_tokens: int = Field(256, ge=1, description="prefix_hash: leading tokens that pick the worker.")
    report_interval_s: float = Field(0.5, gt=0.0, le=10.0, description="How often the router polls each worker "
                                     "for queue length, KV usage and cache events.")
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs reserved per worker replica (fractions allowed).")
    num_gpus: Optional[float] = Field(None, ge=0.0, description="GPUs per worker replica; default: 1 when the Ray "
                                      "cluster has GPUs, else 0.")
    ingress_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress (stateless; the router "
                                  "deployment holds the routing state).")
    ingress_num_cpus: float = Field(0.25, ge=0.0, description="CPUs reserved per ingress replica.")
    router_num_cpus: float = Field(0.1, ge=0.0, description="CPUs reserved by the router replica.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Concurrent requests one worker replica accepts "
                                      "(keep it high: the engine queues and batches).")
    ingress_max_ongoing_requests: int = Field(512, ge=1, description="Concurrent HTTP requests one ingress "
                                              "replica accepts before Serve queues them.")
    api_key: Optional[str] = Field(None, description="When set, /v1/* and /generate need 'Authorization: Bearer "
                                   "<api_key>'.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Request bodies larger than this get a 413.")
    worker_access_log: bool = Field(False, description="Log every call to a worker replica (generate, and the "
                                    "router's report polls several times a second).")
    health_check_period_s: float = Field(2.0, gt=0.0, description="How often Serve checks each worker's health "
                                         "(a dead worker is replaced after a failed check).")


def _engine_fields() -> Dict[str, Any]:
    """One pydantic field per EngineConfig field (type, default and help text copied)."""
    hints = typing.get_type_hints(EngineConfig)
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_EXPOSED:
            continue
        out[f.name] = (hints[f.name], Field(f.default, description=f"Engine: {f.metadata.get('help', f.name)}"))
    return out


ENGINE_OPTIONS = tuple(_engine_fields())


class _Validated(_ClusterFields):
    @model_validator(mode="after")
    def _check_engine(self) -> "_Validated":
        try:
            EngineConfig.from_kwargs(model=self.model, enable_cache_events=True, **self.engine_options())
        except InvalidConfigError as exc:
            raise ValueError(f"invalid engine option: {exc}") from None
        if self.model is not None:
            from engine.models.source import resolve_model  # file checks only, no weights read
            try:
                resolve_model(self.model)
            except Exception as exc:  # noqa: BLE001 - ModelNotFoundError and friends
                raise ValueError(str(exc)) from None
        return self

    def engine_options(self) -> Dict[str, Any]:
        """EngineConfig keyword arguments of every worker (without model / enable_cache_events)."""
        return {name: getattr(self, name) for name in ENGINE_OPTIONS}

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from serving.__main__ import default_model_name
        return default_model_name(self.model)


ClusterArgs = create_model("ClusterArgs", __base__=_Validated, __doc__=__doc__.split("\n\n")[0],
                           __module__=__name__, **_engine_fields())
