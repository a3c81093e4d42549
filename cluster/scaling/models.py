"""What crosses the admin boundary (router deployment ⇄ ingress ⇄ HTTP): the pool status the
PoolScaler reports (ClusterPools → PoolStatus → ReplicaStatus, PoolSample history, histograms) and
the operator's requests (ScaleRequest, DrainRequest); AdminError carries an HTTP status."""

from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.scaling.policy import REPLICA_CAP


class AdminError(Exception):
    """An admin request that cannot be done; `status` is its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)  # both in args: the error crosses Ray by pickling
        self.status, self.message = status, message

    def __str__(self) -> str:
        return self.message


class ReplicaStatus(BaseModel):
    replica_id: str
    state: str = Field(description="starting, running, draining, drained, removing, stopping (or Serve's state).")
    serve_state: Optional[str] = Field(None, description="Serve's replica state (RUNNING, STARTING, ...).")
    routable: bool = Field(description="In the router's routing set.")
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    cache_hit_rate: float = 0.0
    in_flight: int = 0
    routed_requests: int = 0
    generated_tokens: int = 0
    gpus: Optional[float] = Field(
        None,
        description="GPUs Ray reserved for the replica (ClusterArgs num_gpus: one per tensor-parallel rank; "
        "0: CPU); None until its first report.",
    )
    tensor_parallel_size: Optional[int] = Field(
        None, description="Ranks the replica's model is split over; None until its first report."
    )


class PoolSample(BaseModel):
    time: float = Field(description="Unix time.")
    replicas: int
    target: int
    waiting: int
    running: int
    kv_usage: float
    cache_hit_rate: float
    ttft_p90_ms: Optional[float]
    itl_p90_ms: Optional[float]
    tokens_per_s: float


class HistogramView(BaseModel):
    buckets: List[Tuple[str, int]] = Field(description="(upper bound in seconds, cumulative count), last +Inf.")
    sum: float
    count: int


class PoolStatus(BaseModel):
    name: str
    deployment: str
    mode: Literal["autoscaling", "manual"]
    target_replicas: int = Field(description="The pool size the control loop wants.")
    serve_target_replicas: Optional[int] = Field(None, description="The target Serve currently follows.")
    min_replicas: int
    max_replicas: int
    autoscaling: Dict[str, Any] = Field(description="Targets and delays (PoolAutoscaling fields).")
    last_decision: str
    ready_replicas: int
    replicas: List[ReplicaStatus]
    waiting: int
    running: int
    kv_usage: float
    cache_hit_rate: float
    ttft_p90_ms: Optional[float]
    itl_p90_ms: Optional[float]
    tokens_per_s: float
    ttft_histogram: Optional[HistogramView] = None
    itl_histogram: Optional[HistogramView] = None
    history: List[PoolSample] = Field(default_factory=list)


class ClusterPools(BaseModel):
    time: float
    pools: List[PoolStatus]


class ScaleRequest(BaseModel):
    """Either a fixed size (`replicas`; autoscaling off) or autoscaling with optional new bounds."""

    model_config = ConfigDict(extra="forbid")
    replicas: Optional[int] = Field(None, ge=1, le=REPLICA_CAP, description="Fixed pool size (manual mode).")
    autoscaling: Optional[bool] = Field(
        None, description="true: autoscale within the bounds; false: keep the current size fixed."
    )
    min_replicas: Optional[int] = Field(None, ge=1, le=REPLICA_CAP)
    max_replicas: Optional[int] = Field(None, ge=1, le=REPLICA_CAP)

    @model_validator(mode="after")
    def _one_mode(self) -> "ScaleRequest":
        bounds = self.min_replicas is not None or self.max_replicas is not None
        if self.replicas is not None and (bounds or self.autoscaling):
            raise ValueError("give either replicas or autoscaling bounds, not both")
        if self.autoscaling is False and bounds:
            raise ValueError("autoscaling bounds given with autoscaling=false")
        if self.replicas is None and self.autoscaling is None and not bounds:
            raise ValueError("nothing to change: give replicas, or autoscaling / min_replicas / max_replicas")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    remove: bool = Field(False, description="Once drained, stop the replica and shrink its pool by one.")
