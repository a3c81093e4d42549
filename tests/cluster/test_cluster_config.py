"""ClusterArgs and the builder, without a Ray cluster: fast checks that bad config fails early."""

import typing

import pytest
from pydantic import ValidationError

from cluster.app import deployment
from cluster.config import ENGINE_OPTIONS, ClusterArgs
from cluster.router import available_policies
from engine.config import EngineConfig


def test_defaults_and_cli_strings():
    args = ClusterArgs.model_validate(
        {"workers": "2", "policy": "round_robin", "page_size": "16", "num_cpus": "0.5", "cache_threshold": "0.3"}
    )
    assert (args.workers, args.policy, args.page_size, args.num_cpus) == (2, "round_robin", 16, 0.5)
    assert args.engine_options()["page_size"] == 16
    assert ClusterArgs().workers == 1 and ClusterArgs().policy == "cache_aware"
    assert ClusterArgs().model_name() == "SmolLM2-135M-Instruct"


def test_every_field_is_described():
    for name, f in ClusterArgs.model_fields.items():
        assert f.description, name


def test_policies_match_the_registry():
    assert set(typing.get_args(ClusterArgs.model_fields["policy"].annotation)) == set(available_policies())


def test_engine_options_follow_engine_config():
    import dataclasses

    from cluster.config import _NOT_EXPOSED

    assert set(ENGINE_OPTIONS) == {f.name for f in dataclasses.fields(EngineConfig)} - _NOT_EXPOSED
    assert "page_size" in ENGINE_OPTIONS and "skip_tokenizer_init" not in ENGINE_OPTIONS


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"workers": 0}, "workers"),
        ({"policy": "fastest"}, "policy"),
        ({"wokers": 2}, "wokers"),
        ({"cache_threshold": 2}, "cache_threshold"),
        ({"page_size": 0}, "page_size"),
        ({"schedule_policy": "sjf"}, "schedule_policy"),
        ({"model": "/no/such/model"}, "not found"),
        ({"dtype": "int3"}, "dtype"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_invalid_config_fails_fast(bad, where):
    with pytest.raises(ValidationError) as info:
        ClusterArgs.model_validate(bad)
    assert where in str(info.value)


def test_disaggregated_pools_share_the_tensor_parallel_size():
    """One tensor_parallel_size for both pools: prefill and decode replicas hand KV over rank to rank."""
    args = ClusterArgs(mode="disaggregated", tensor_parallel_size=2)
    assert args.engine_options()["tensor_parallel_size"] == 2


def test_disaggregated_workers_run_their_core_in_a_process_only_when_asked():
    """A disaggregated worker's core runs in its worker's process unless core_process=true is given; then its
    pool is shared with the worker (its KV transfer maps it), and tensor parallelism is refused."""
    default = ClusterArgs(mode="disaggregated").engine_options()
    assert default["core_process"] is False and default["share_kv_pool"] is False
    asked = ClusterArgs(mode="disaggregated", core_process=True).engine_options()
    assert asked["core_process"] is True and asked["share_kv_pool"] is True
    assert ClusterArgs(workers=1).engine_options()["core_process"] is True  # unified: the server's default
    assert ClusterArgs(workers=1).engine_options()["share_kv_pool"] is False
    with pytest.raises(ValidationError, match="tensor_parallel_size 1"):
        ClusterArgs(mode="disaggregated", core_process=True, tensor_parallel_size=2)


def test_builder_wires_three_deployments():
    app = deployment(ClusterArgs(workers=3, policy="prefix_hash", num_cpus=0.5, num_gpus=0))
    ingress = app._bound_deployment
    assert ingress.name == "Ingress"
    router, worker = ingress.init_args[0], ingress.init_args[1]
    assert router._bound_deployment.name == "Router" and worker._bound_deployment.name == "Worker"
    wd = worker._bound_deployment
    auto = wd._deployment_config.autoscaling_config  # pool size: the app's PoolScaler, Serve follows it
    assert auto.initial_replicas == 3 and auto.policy.policy_function.endswith("FollowPoolTarget")
    assert wd.ray_actor_options["num_cpus"] == 0.5
    assert wd._deployment_config.request_router_config.request_router_class.endswith("PinnedRequestRouter")
    assert router._bound_deployment.init_args[1] == "prefix_hash"


def test_ingress_event_loop_reaches_the_replicas_runtime_env():
    def ingress_env(**kw):
        app = deployment(ClusterArgs(num_cpus=0.5, **kw))
        return app._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]

    # auto: asyncio for CPU workers (every pending connection accepted at once), uvloop for GPU workers
    assert ingress_env(num_gpus=0) == {"RAY_USE_UVLOOP": "0"}
    assert ingress_env(num_gpus=1) == {"RAY_USE_UVLOOP": "1"}
    assert ingress_env(num_gpus=0, ingress_event_loop="uvloop") == {"RAY_USE_UVLOOP": "1"}
    assert ingress_env(num_gpus=1, ingress_event_loop="asyncio") == {"RAY_USE_UVLOOP": "0"}
    with pytest.raises(ValueError):
        ClusterArgs(ingress_event_loop="trio")


def test_workers_reserve_a_gpu_per_tensor_parallel_rank(monkeypatch):
    import cluster.app

    monkeypatch.setattr(cluster.app, "_cluster_resources", lambda: {"CPU": 8.0, "GPU": 4.0})
    assert cluster.app._gpus_per_worker(ClusterArgs(tensor_parallel_size=2)) == 2.0
    assert cluster.app._gpus_per_worker(ClusterArgs(tensor_parallel_size=2, num_gpus=1)) == 1.0
    monkeypatch.setattr(cluster.app, "_cluster_resources", lambda: {"CPU": 8.0, "GPU": 0.0})
    assert cluster.app._gpus_per_worker(ClusterArgs(tensor_parallel_size=2)) == 0.0


def test_serve_config_yaml_args_are_valid():
    import pathlib

    import yaml

    doc = yaml.safe_load((pathlib.Path(__file__).parents[2] / "deploy" / "serve_config.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "cluster.app:deployment"
    ClusterArgs.model_validate(app["args"])


def test_default_worker_cpus_fit_a_small_ray_cluster(monkeypatch):
    """Without num_cpus, every initial worker replica gets 1 CPU or an equal share of what the ingress
    and the router leave, so `mode=disaggregated` starts on a 2-CPU machine."""
    import cluster.app as app_module

    monkeypatch.setattr(app_module.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(app_module.ray, "cluster_resources", lambda: {"CPU": 2.0})
    share = app_module._cpus_per_worker
    assert share(ClusterArgs()) == 1.0  # 1 worker: 1.65 spare
    assert share(ClusterArgs(mode="disaggregated")) == 0.8  # 2 workers share 1.65
    assert share(ClusterArgs(workers=8)) == 0.2
    assert share(ClusterArgs(workers=8, num_cpus=1)) == 1  # explicit wins
    monkeypatch.setattr(app_module.ray, "is_initialized", lambda: False)  # `serve run` before Ray starts
    monkeypatch.setattr(app_module.os, "cpu_count", lambda: 2)
    assert share(ClusterArgs(mode="disaggregated")) == 0.8


def test_rate_limits_are_shared_between_ingress_replicas():
    from serving.ratelimit import RateLimits

    assert not ClusterArgs().rate_limits(1).enabled  # off by default
    args = ClusterArgs(rate_limit_requests_per_minute=100, rate_limit_tokens_per_minute=90_001)
    assert args.rate_limits(3) == RateLimits(34, 30_001)


def test_ingress_replicas_default_to_one_per_8_cpus():
    from cluster.config import default_ingress_replicas

    assert ClusterArgs().ingress_replicas is None  # resolved from the Ray cluster's CPUs when deployed
    assert [default_ingress_replicas(c) for c in (2, 8, 16, 31, 64, 224)] == [1, 1, 2, 3, 4, 4]
    with pytest.raises(ValidationError, match="ingress_replicas"):
        ClusterArgs(ingress_replicas=0)
    with pytest.raises(ValidationError, match="rate_limit_tokens_per_minute"):
        ClusterArgs(rate_limit_tokens_per_minute=0)


def test_cors_origins_are_off_by_default_and_parsed_for_the_ingress_app():
    from serving.app import parse_origins

    assert ClusterArgs().cors_origins is None and parse_origins(ClusterArgs().cors_origins) == []
    args = ClusterArgs(cors_origins="https://a.example, https://b.example")  # as `serve run ... key=value` gives it
    assert parse_origins(args.cors_origins) == ["https://a.example", "https://b.example"]


def test_response_store_limits_reach_the_router_and_the_ingress():
    from serving.response_store import StoreLimits

    assert ClusterArgs().response_store_limits() == StoreLimits()  # 1024 responses, 64 MiB
    args = ClusterArgs.model_validate({"response_store_max_entries": "10", "response_store_max_bytes": "4096"})
    app = deployment(args.model_copy(update={"num_cpus": 0.5, "num_gpus": 0}))
    ingress = app._bound_deployment
    router = ingress.init_args[0]._bound_deployment
    assert router.init_kwargs["response_store"] == ingress.init_kwargs["response_store"] == StoreLimits(10, 4096)
    assert not ClusterArgs(response_store_max_entries=0).response_store_limits().enabled  # 0: store disabled
    for bad in ({"response_store_max_entries": -1}, {"response_store_max_bytes": "lots"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ClusterArgs.model_validate(bad)
