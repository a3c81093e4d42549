"""`cluster.app:deployment`: the Ray Serve application builder.

    serve run cluster.app:deployment                                  # 1 worker, default model
    serve run cluster.app:deployment workers=2 policy=round_robin model=/models/x.gguf
    serve deploy deploy/serve_config.yaml                             # same args under `args:`

Deployments (one application):

    mode=unified (default)
    Ingress  (ingress_replicas)  HTTP, FastAPI routes of serving/, tokenizes once
      ├─▶ Router (1 replica)      ClusterState + policy per pool; polls workers; /router/stats
      └─▶ Worker (workers)        one engine.Engine each; calls pinned by PinnedRequestRouter
    Router ─▶ Worker (reports, membership)

    mode=disaggregated                                      (cluster/workers/, cluster/ingress/disaggregated.py)
    Ingress ─▶ Router.route_pair ─▶ (prefill replica, decode replica)
    Ingress ─▶ Prefill.start_prefill (early_prefill: the prompt starts computing at once)
    Ingress ─▶ Decode (decode_workers) ─▶ Prefill (prefill_workers): KV pages written into the
               decode replica's pool through cluster.kv_transfer (nixl | nccl), then decode streams

No `from __future__ import annotations` in this module: Serve validates the builder's argument
with the annotated pydantic model only when the annotation is a real class (docs/design.md).
"""

import logging
import os

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterArgs, default_ingress_replicas
from engine.errors import InvalidConfigError
from cluster.ingress.deployment import Ingress
from cluster.router.router import RouterDeployment
from cluster.scaling.policy import deployment_options, scaling_config
from cluster.workers.base import HEALTH_CALL_TIMEOUT_S
from cluster.workers.decode import DecodeWorker
from cluster.workers.prefill import PrefillWorker
from cluster.workers.unified import Worker

logger = logging.getLogger("ray.serve")

PINNED_ROUTER = "cluster.pinning:PinnedRequestRouter"
SHUTDOWN_POLL_S = 0.5
"""How often a stopping replica (ingress, router, worker) checks whether its requests are over (Serve's default is 2 s):
a replica stops at most this long after its last request ended."""


def _cluster_resources() -> dict:
    """CPUs and GPUs of the Ray cluster the application will run on. `serve run` calls the builder
    before it starts or joins Ray: then the local machine's, which is where its local cluster runs."""
    if ray.is_initialized():
        return ray.cluster_resources()
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


def _gpus_per_worker(args) -> float:
    """args.num_gpus, else one GPU per tensor-parallel rank when the Ray cluster has GPUs, else none."""
    if args.num_gpus is not None:
        return args.num_gpus
    return float(args.tensor_parallel_size) if _cluster_resources().get("GPU", 0) > 0 else 0.0


def _ingress_replicas(args) -> int:
    if args.ingress_replicas is not None:
        return args.ingress_replicas
    return default_ingress_replicas(_cluster_resources().get("CPU", 0.0))


def ingress_runtime_env(args: ClusterArgs, num_gpus: float) -> dict:
    """Runtime env of the ingress replicas, which sets their event loop (`ingress_event_loop`; 'auto': uvloop
    when the workers have GPUs (`num_gpus` per worker), else asyncio). Ray builds an actor's loop with uvloop
    unless RAY_USE_UVLOOP is 0 in its process (docs/serving-path.md, "Accepting connections")."""
    loop = args.ingress_event_loop
    if loop == "auto":
        loop = "uvloop" if num_gpus > 0 else "asyncio"
    return {"env_vars": {"RAY_USE_UVLOOP": "1" if loop == "uvloop" else "0"}}


def _cpus_per_worker(args) -> float:
    """args.num_cpus, else 1 CPU per worker replica, or less when the Ray cluster's CPUs (minus the
    ingress's and the router's) cannot give every initial replica one."""
    if args.num_cpus is not None:
        return args.num_cpus
    cpus = _cluster_resources().get("CPU", 0.0)
    spare = cpus - _ingress_replicas(args) * args.ingress_num_cpus - args.router_num_cpus
    share = spare / sum(args.pool_sizes().values())
    return max(0.05, min(1.0, int(share * 20) / 20))  # multiples of 0.05 CPU


def _pool_deployment(cls, name: str, pool: str, args: ClusterArgs, num_gpus: float, scaling):
    """A worker pool's Serve deployment: pinned routing, health checks, its own (auto)scaling."""
    return serve.deployment(cls).options(
        name=name,
        **deployment_options(scaling, pool),
        max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": _cpus_per_worker(args), "num_gpus": num_gpus},
        request_router_config=RequestRouterConfig(request_router_class=PINNED_ROUTER),
        health_check_period_s=args.health_check_period_s,
        health_check_timeout_s=2 * HEALTH_CALL_TIMEOUT_S,  # the worker's own check fails first, with a log line
        graceful_shutdown_timeout_s=5,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        logging_config={"enable_access_log": args.worker_access_log},
    )


def _check_transfer(args: ClusterArgs, num_gpus: float) -> None:
    if args.kv_transfer == "nccl" and num_gpus <= 0:
        raise InvalidConfigError("kv_transfer=nccl needs GPU workers (num_gpus > 0); use kv_transfer=nixl on CPU")


def deployment(args: ClusterArgs) -> Application:
    """Build the application from validated ClusterArgs: a unified pool, or prefill + decode pools."""
    if isinstance(args, dict):  # Python callers may pass a plain dict
        args = ClusterArgs.model_validate(args)
    num_gpus = _gpus_per_worker(args)
    scaling = scaling_config(args)  # pool sizes: the router's PoolScaler, followed by Serve (scaling/policy.py)
    if args.mode == "unified":
        worker = _pool_deployment(Worker, "Worker", "unified", args, num_gpus, scaling).bind(
            args.model, args.engine_options()
        )
        pools = {"unified": worker}
    else:
        _check_transfer(args, num_gpus)
        prefill = _pool_deployment(PrefillWorker, "Prefill", "prefill", args, num_gpus, scaling).bind(
            args.model, args.engine_options(), args.kv_transfer, args.kv_transfer_timeout_s
        )
        worker = _pool_deployment(DecodeWorker, "Decode", "decode", args, num_gpus, scaling).bind(
            args.model, args.engine_options(), prefill, args.kv_transfer, args.kv_transfer_timeout_s
        )
        pools = {"prefill": prefill, "decode": worker}
    router_config = dict(
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_tokens=args.max_tree_tokens,
        page_size=args.page_size,
        prefix_hash_tokens=args.prefix_hash_tokens,
    )
    router = (
        serve.deployment(RouterDeployment)
        .options(
            name="Router",
            num_replicas=1,
            max_ongoing_requests=4096,
            ray_actor_options={"num_cpus": args.router_num_cpus},
            graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        )
        .bind(
            pools,
            args.policy,
            router_config,
            args.report_interval_s,
            scaling=scaling,
            response_store=args.response_store_limits(),
        )
    )
    ingress = (
        serve.deployment(Ingress)
        .options(
            name="Ingress",
            num_replicas=_ingress_replicas(args),
            max_ongoing_requests=args.ingress_max_ongoing_requests,
            ray_actor_options={"num_cpus": args.ingress_num_cpus, "runtime_env": ingress_runtime_env(args, num_gpus)},
            graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        )
        .bind(
            router,
            worker,
            args.model,
            args.model_name(),
            args.api_key,
            args.max_body_bytes,
            admin_api_key=args.admin_api_key,
            request_timeout_s=args.request_timeout_s,
            rate_limits=args.rate_limits(_ingress_replicas(args)),
            cors_origins=args.cors_origins,
            response_store=args.response_store_limits(),
            mode=args.mode,
            tokenizer_source=args.tokenizer,
            prefill=pools.get("prefill") if args.early_prefill else None,
        )
    )
    logger.info(
        "radixserve: %s mode, pools %s of %s, policy %s, %.2g GPU(s) per worker",
        args.mode,
        args.pool_sizes(),
        args.model_name(),
        args.policy,
        num_gpus,
    )
    return ingress
