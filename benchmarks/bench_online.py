"""Online serving side by side: vLLM's server, `python -m serving` and the Ray Serve cluster, one run.

Each server is started in turn as a subprocess, waited on until /v1/models answers, driven with the
same client (bench_serving.run_load) on the same workloads, then stopped and cleaned up before the
next one starts. Prints one table with each radixserve server's ratios to vLLM, writes JSON and a
PNG of req/s, TTFT p50, ITL p50 and TPOT per workload per server. Asserts nothing about timings.

Servers (--servers, in this order by default: vllm serving cluster):
  vllm            `bash VLLM_SERVE MODEL_DIR PORT [--vllm-args]`: vLLM's OpenAI server on dummy
                  weights (served name "m"); VLLM_SERVE is --vllm-serve-script (benchmarks/vllm_serve.sh)
  serving         `python -m serving --model MODEL_DIR --load-format dummy --served-model-name m
                  --port PORT [--serving-args]`
  serving-switch  the same, started with sys.setswitchinterval(--switch-interval) (GIL hand-over
                  every 0.2 ms instead of Python's 5 ms): diagnosis of the one-process server
  cluster         `serve run cluster.app:deployment model=MODEL_DIR load_format=dummy
                  served_model_name=m [--cluster-args]` with RAY_SERVE_USE_GRPC_BY_DEFAULT=1,
                  RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_THROUGHPUT_OPTIMIZED=1 unless set
                  otherwise (deploy/serve.sh's defaults), HAProxy on port 8000;
                  stopped with SIGINT, then every process it started is ended by id
                  (--ray-stop adds `ray stop --force`: only where no other Ray runs)
  bare            engine.Engine in a child process, no HTTP (engine options from --serving-args);
                  a token event is each streamed engine output with new token ids (one per engine
                  step), so its ITL is the engine's own. Single-turn workloads only
With --model-dir '' the servers run the default model without --load-format dummy (a CPU smoke test;
vllm is then unavailable).

Workloads (--workloads; bench_serving options, all with --ignore-eos and temperature 0; each workload
has its own fixed seed, so no workload sends another's prompts again):
  random-1       completions, 128 → 256 tokens, 1 in flight (batch-1 TPOT through the endpoint)
  random-8/64/256  completions, 1024 → 256, 8/64/256 in flight; the request count is 8x the
                 concurrency (2x at 256), so that most of a run is steady state (about 15-40 s each)
  shared-prefix  chat, 16 groups × 16 questions, 2048-word system prompt, 64-word question, 128 out,
                 64 in flight
  multi-turn     chat, 32 conversations × 6 turns, 64-word questions, 128 out, all in flight
--count WORKLOAD=N sets a workload's size (random: requests; shared-prefix: groups; multi-turn:
conversations); arguments after `--` go to every workload's bench_serving options and win (e.g.
`-- --input-len 64 --output-len 8` for a smoke test). --repeat N runs each workload N times back to back
(run k with seed + k × REPEAT_SEED_STEP: new prompts); the table and ratios use the run of median req/s,
and the JSON's `repeats` lists every run (at 256 in flight, closed-loop runs of one server land in a
slow or a fast mode, so one run can mislead). Each server gets --warmup-requests short
requests before its first workload, not measured. Between the workloads of one server nothing is
restarted: its prefix cache persists across workloads (every workload draws prompts no earlier one
sent, so this favours no server).

Per server and workload the JSON holds bench_serving's summary (req/s, output tok/s, TTFT / ITL /
E2E / TPOT percentiles, errors, stream events per output token, the host CPU's speed before and after
the run and the hypervisor's steal meanwhile: `host_speed`, host_probe.py), and for radixserve servers the
ratios to vLLM's figure of the same workload (throughput: ours / vLLM; latencies: ours / vLLM). After
each workload a radixserve server's KV counters are read once it is idle (cluster: /router/stats,
workers[*].engine; serving: /metrics, its radixserve_kv_cache_{total,free,evictable}_tokens gauges;
bare: engine.stats()) and `kv_no_leak` records free + evictable == total. For the cluster, each
workload's mean TTFT is also split (`ttft_split_ms`, from /router/stats counters read before and after
it): the ingress's routing call, its worker call to the first message with tokens (of which the worker's
own call start to first output), and the rest (HAProxy, HTTP, the serving layer and tokenization in the
ingress).

--engine-tpot first runs `bench_decode.py --engine-tpot` on the model's config (an Engine in a child
process, batch 1, the random-1 shape, before any server starts) and records each radixserve server's
random-1 TPOT over it (`tpot_endpoint_over_engine`): the endpoint's cost per token, from one run.

--crosscheck SERVER:WORKLOAD (e.g. vllm:random-64, a random workload) runs `vllm bench serve`
(--vllm-bench-cmd: vLLM's CLI with VLLM_PYTHONPATH / VLLM_PYTHON, as vllm_serve.sh runs it) against
the same server right after our client's run of that workload, same shape (input / output length,
concurrency, request count, --ignore-eos, temperature 0), and records both clients' req/s, TTFT p50,
ITL p50, their ratios and whether they agree within 5%, and both clients' mean prompt tokens (ours are
words, ~1 token each; vLLM's random dataset decodes random token ids to text, which the server
tokenizes again).

--torch-profile serving:WORKLOAD runs that workload once more with a torch profiler trace of the engine
(POST /start_profile, --torch-profile-steps steps) and reports where the device sat idle (trace_gaps.py).
--profile SERVER:WORKLOAD with --py-spy PATH runs that workload once more after its measured run
with `py-spy record` (all threads, and the GIL holder) and one `py-spy dump` attached to the server
process (serving / serving-switch); the raw stacks go beside the logs, the run is not in the table.

  python benchmarks/bench_online.py --model-dir .gpu-model/llama-3.1-8b \\
      --workloads random-1 random-8 random-64 \\
      --crosscheck vllm:random-64 --log-dir $OUT
  python benchmarks/bench_online.py --model-dir '' --servers serving --workloads random-8 \\
      --count random-8=8 --warmup-requests 1 -- --input-len 64 --output-len 8       # CPU smoke test

Writes benchmarks/results/online_<GPU or cpu>.json (--out; per workload its summary and `timeline`, each
request's send time, TTFT and E2E) and the PNG beside it; --merge keeps
what an existing JSON holds that this run does not measure (a second command on the same machine: other
servers, and a server's other workloads, its earlier starts listed in `earlier_starts`) and recomputes the
ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving as bs  # noqa: E402
import host_probe  # noqa: E402
from bench_offline import result_path  # noqa: E402

SERVED_NAME = "m"
COMMON = ["--ignore-eos", "--temperature", "0"]
RANDOM_1024 = ["--dataset", "random", "--input-len", "1024", "--range-ratio", "0", "--output-len", "256"]
WORKLOADS: Dict[str, List[str]] = {
    "random-1": [
        "--dataset",
        "random",
        "--input-len",
        "128",
        "--range-ratio",
        "0",
        "--output-len",
        "256",
        "--max-concurrency",
        "1",
        "--num-prompts",
        "8",
    ],
    "random-8": RANDOM_1024 + ["--max-concurrency", "8", "--num-prompts", "64"],
    "random-64": RANDOM_1024 + ["--max-concurrency", "64", "--num-prompts", "512"],
    "random-256": RANDOM_1024 + ["--max-concurrency", "256", "--num-prompts", "512"],
    "shared-prefix": [
        "--dataset",
        "shared-prefix",
        "--num-groups",
        "16",
        "--prompts-per-group",
        "16",
        "--system-prompt-len",
        "2048",
        "--question-len",
        "64",
        "--output-len",
        "128",
        "--max-concurrency",
        "64",
    ],
    "multi-turn": [
        "--dataset",
        "multi-turn",
        "--num-conversations",
        "32",
        "--num-turns",
        "6",
        "--question-len",
        "64",
        "--output-len",
        "128",
        "--history",  # every server is sent the same conversations (dummy weights answer differently)
        "dataset",
    ],
}
WARMUP_SEED = 1000


def workload_seed(name: str) -> int:
    """Each workload draws its prompts with its own seed: with one seed, random-8's 64 prompts would be
    the first 64 of random-64 (same length), already in every server's prefix cache."""
    return list(WORKLOADS).index(name) + 1


COUNT_FLAG = {"random": "--num-prompts", "shared-prefix": "--num-groups", "multi-turn": "--num-conversations"}
SERVERS = ("vllm", "serving", "serving-switch", "cluster", "bare")
RADIXSERVE = ("serving", "serving-switch", "cluster", "bare")
THROUGHPUT_KEYS = ("request_throughput", "output_throughput_tok_s")
LATENCY_KEYS = ("ttft_ms.p50", "ttft_ms.p90", "itl_ms.p50", "itl_ms.p90", "e2e_ms.p50", "tpot_ms.mean")
SUMMARY_KEYS = THROUGHPUT_KEYS + LATENCY_KEYS + ("failed",)


def lookup(summary: Dict[str, Any], key: str) -> Optional[float]:
    """summary[key], "a.b" reading summary[a][b]; None when absent."""
    value: Any = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return None if value is None else float(value)


def engine_tpot_argv(model_dir: str, out: str) -> List[str]:
    """bench_decode.py --engine-tpot on MODEL_DIR's config.json, at the shape of the random-1 workload: an
    Engine's own batch-1 time per output token, the figure each endpoint's random-1 TPOT is compared with."""
    shape = WORKLOADS["random-1"]
    return [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_decode.py"),
        "--config",
        os.path.join(model_dir, "config.json"),
        "--batch-sizes",
        "1",
        "--steps",
        "20",
        "--engine-tpot",
        "--tpot-input-len",
        shape[shape.index("--input-len") + 1],
        "--tpot-output-len",
        shape[shape.index("--output-len") + 1],
        "--out",
        out,
    ]


def engine_tpot(model_dir: str, log_dir: str, timeout: float) -> Dict[str, Any]:
    """Runs engine_tpot_argv in a child process (before any server, so it has the GPU to itself); its
    `engine_tpot` record (tpot_ms, first_token_s, ...) plus the command. Raises when it fails."""
    out = os.path.join(log_dir, "engine_tpot.json")
    cmd = engine_tpot_argv(model_dir, out)
    with open(os.path.join(log_dir, "engine_tpot.log"), "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"bench_decode.py --engine-tpot exited with {p.returncode} (engine_tpot.log)")
    with open(out) as f:
        result = json.load(f)["engine_tpot"]
    return dict(result, command=shlex.join(cmd), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))


def endpoint_over_engine(record: Dict[str, Any]) -> Dict[str, float]:
    """Each radixserve server's random-1 TPOT (mean) over the engine's own (`engine_tpot`), where both ran."""
    engine = (record.get("engine_tpot") or {}).get("tpot_ms")
    out: Dict[str, float] = {}
    for server, run in record.get("runs", {}).items():
        tpot = lookup(run.get("workloads", {}).get("random-1") or {}, "tpot_ms.mean")
        if server in RADIXSERVE and engine and tpot is not None:
            out[server] = tpot / engine
    return out


REPEAT_SEED_STEP = 10_000
"""Repeat k (0 = the first run) of a workload draws its prompts with the workload's seed + k × this: new
prompts each time, so a repeat finds none of its prompts in the prefix cache the runs before it filled."""


def workload_argv(name: str, counts: Dict[str, int], extra: List[str], repeat: int = 0) -> List[str]:
    """bench_serving options of one workload (its `repeat`-th run): its own, then --count's size, then the
    common extra ones."""
    argv = list(WORKLOADS[name]) + COMMON + ["--seed", str(workload_seed(name) + REPEAT_SEED_STEP * repeat)]
    if name in counts:
        dataset = argv[argv.index("--dataset") + 1]
        argv += [COUNT_FLAG[dataset], str(counts[name])]
    return argv + list(extra)


def parse_counts(items: List[str]) -> Dict[str, int]:
    counts = {}
    for item in items:
        name, _, n = item.partition("=")
        if name not in WORKLOADS or not n.isdigit():
            raise SystemExit(f"--count takes WORKLOAD=N with WORKLOAD in {sorted(WORKLOADS)}: {item!r}")
        counts[name] = int(n)
    return counts


def pairs(items: List[str], what: str) -> List[tuple]:
    out = []
    for item in items:
        server, _, workload = item.partition(":")
        if server not in SERVERS or workload not in WORKLOADS:
            raise SystemExit(f"{what} takes SERVER:WORKLOAD: {item!r}")
        out.append((server, workload))
    return out


# --- the report: ratios, table, plot -------------------------------------------------------------


def median_run(summaries: List[Dict[str, Any]]) -> int:
    """Index of the run of median req/s among `summaries` (for an even count, the slower of the two middle
    ones); runs with a failed request count only when every run had one."""
    runs = [i for i, summary in enumerate(summaries) if not summary.get("failed")] or list(range(len(summaries)))
    runs.sort(key=lambda i: -(lookup(summaries[i], "request_throughput") or 0.0))
    return runs[len(runs) // 2]


def repeat_figures(summary: Dict[str, Any], argv: List[str]) -> Dict[str, Any]:
    """One run of a repeated workload as its JSON keeps it: its seed (bench_serving takes the last --seed)
    and the table's figures."""
    seed_at = len(argv) - 1 - argv[::-1].index("--seed")
    figures = {key: lookup(summary, key) for key in SUMMARY_KEYS + ("ttft_ms.mean", "events_per_output_token")}
    return dict(figures, seed=int(argv[seed_at + 1]), host_speed=summary.get("host_speed"))


def ratios(runs: Dict[str, Dict[str, Any]], reference: str = "vllm") -> Dict[str, Dict[str, Dict[str, float]]]:
    """server → workload → {key: ours / reference} for every server but the reference, where both
    measured the workload with no failed request. Throughput and latency ratios alike are ours over
    the reference (throughput: > 1 is better; latency: < 1 is better)."""
    ref = runs.get(reference, {}).get("workloads", {})
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for server, run in runs.items():
        if server == reference:
            continue
        for workload, summary in run.get("workloads", {}).items():
            base = ref.get(workload)
            if not base or not summary.get("completed") or not base.get("completed"):
                continue
            row = {}
            for key in THROUGHPUT_KEYS + LATENCY_KEYS:
                ours, theirs = lookup(summary, key), lookup(base, key)
                if ours is not None and theirs:
                    row[key] = ours / theirs
            out.setdefault(server, {})[workload] = row
    return out


COLUMNS = (
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput_tok_s", "out tok/s", "{:.0f}"),
    ("ttft_ms.p50", "TTFT p50", "{:.1f}"),
    ("ttft_ms.p90", "TTFT p90", "{:.1f}"),
    ("itl_ms.p50", "ITL p50", "{:.2f}"),
    ("itl_ms.p90", "ITL p90", "{:.2f}"),
    ("e2e_ms.p50", "E2E p50", "{:.0f}"),
    ("tpot_ms.mean", "TPOT", "{:.2f}"),
    ("events_per_output_token", "ev/tok", "{:.2f}"),
)
RATIO_COLUMNS = (
    ("request_throughput", "x req/s"),
    ("ttft_ms.p50", "x TTFT50"),
    ("itl_ms.p50", "x ITL50"),
    ("tpot_ms.mean", "x TPOT"),
)


def ordered(runs: Dict[str, Any]) -> Dict[str, Any]:
    """The runs in SERVERS order (vLLM first)."""
    return dict(sorted(runs.items(), key=lambda kv: SERVERS.index(kv[0]) if kv[0] in SERVERS else len(SERVERS)))


def table(record: Dict[str, Any]) -> str:
    """One row per server and workload (latencies in ms), with ratios to vLLM where it ran."""
    runs, rat = ordered(record.get("runs", {})), record.get("ratios_to_vllm", {})
    workloads = [w for w in WORKLOADS if any(w in r.get("workloads", {}) for r in runs.values())]
    head = (
        f"{'workload':<14}{'server':<16}"
        + "".join(f"{c[1]:>10}" for c in COLUMNS)
        + f"{'fail':>6}"
        + "".join(f"{c[1]:>10}" for c in RATIO_COLUMNS)
    )
    lines = [head, "-" * len(head)]
    for w in workloads:
        for server, run in runs.items():
            s = run.get("workloads", {}).get(w)
            if s is None:
                continue
            cells = []
            for key, _, fmt in COLUMNS:
                v = lookup(s, key)
                cells.append(f"{fmt.format(v) if v is not None else '-':>10}")
            r = rat.get(server, {}).get(w, {})
            ratio_cells = "".join(f"{(f'{r[k]:.2f}' if k in r else ''):>10}" for k, _ in RATIO_COLUMNS)
            lines.append(f"{w:<14}{server:<16}" + "".join(cells) + f"{s.get('failed', 0):>6}" + ratio_cells)
    return "\n".join(lines)


def plot(record: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot")
        return None
    runs = ordered(record.get("runs", {}))
    servers = [s for s in runs if runs[s].get("workloads")]
    workloads = [w for w in WORKLOADS if any(w in runs[s]["workloads"] for s in servers)]
    if not servers or not workloads:
        return None
    panels = (
        ("request_throughput", "requests/s"),
        ("ttft_ms.p50", "TTFT p50 (ms)"),
        ("itl_ms.p50", "ITL p50 (ms)"),
        ("tpot_ms.mean", "TPOT mean (ms)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    width = 0.8 / len(servers)
    for ax, (key, label) in zip(axes, panels):
        for i, server in enumerate(servers):
            xs, ys = [], []
            for j, w in enumerate(workloads):
                v = lookup(runs[server]["workloads"].get(w, {}), key)
                if v is not None:
                    xs.append(j + (i - (len(servers) - 1) / 2) * width)
                    ys.append(v)
            ax.bar(xs, ys, width, label=server)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=30, ha="right")
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(servers))
    hw = record.get("hardware", {})
    fig.suptitle(f"online serving, {record.get('model', '')} on {hw.get('gpu') or hw.get('cpu', '')}")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- processes -----------------------------------------------------------------------------------


def _descendants(pid: int) -> List[int]:
    """Every live descendant of `pid` (from /proc), children first."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _session_members(sid: int) -> List[int]:
    """Processes of session `sid` (a server started with start_new_session has its own)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _end(pids: List[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _wait_gone(pids: List[int], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.5)
    return [p for p in pids if _alive(p)]


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """A server process tree started in its own session; stop() ends every process it started."""

    name = ""
    port = 0

    def __init__(self, args, log_dir: str):
        self.args, self.log_dir = args, log_dir
        self.proc: Optional[subprocess.Popen] = None
        self.pid: Optional[int] = None  # the process to profile
        self.tree: List[int] = []
        self.started_s = 0.0
        self._log_read = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def new_stats_lines(self) -> List[str]:
        """The engine's stats lines (engine/core/stats_log.py) that the server logged since the last call."""
        path = os.path.join(self.log_dir, f"server_{self.name}.log")
        if not os.path.exists(path):
            return []
        with open(path, errors="replace") as f:
            f.seek(self._log_read)
            text = f.read()
            self._log_read = f.tell()
        mark = "engine.core.stats_log: "
        return [line.split(mark, 1)[1] for line in text.splitlines() if mark in line]

    def command(self) -> List[str]:
        raise NotImplementedError

    def env(self) -> Dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def start(self) -> None:
        if _port_open(self.port):
            raise RuntimeError(f"port {self.port} is already in use")
        log = open(os.path.join(self.log_dir, f"server_{self.name}.log"), "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(), cwd=ROOT, start_new_session=True
        )
        self.pid = self.proc.pid
        self.wait_ready(t0)
        self.started_s = time.perf_counter() - t0

    def wait_ready(self, t0: float) -> None:
        deadline = t0 + self.args.start_timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None and not self.detached():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before answering /v1/models")
            try:
                r = httpx.get(f"{self.base_url}/v1/models", timeout=5)
                if r.status_code == 200 and SERVED_NAME in r.text:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer /v1/models within {self.args.start_timeout} s")

    def detached(self) -> bool:
        """The launcher exits once the server runs (vllm_serve.sh)."""
        return False

    def snapshot_tree(self) -> None:
        if self.proc is not None:
            self.tree = sorted(set(self.tree) | set(_descendants(self.proc.pid)) | set(_session_members(self.proc.pid)))

    def stop(self) -> Dict[str, Any]:
        if self.proc is None:
            return {}
        self.snapshot_tree()
        t0 = time.perf_counter()
        self.signal_stop()
        left = _wait_gone([self.proc.pid] + self.tree, self.args.stop_timeout)
        forced = sorted(set(left) | set(p for p in _session_members(self.proc.pid) if _alive(p)))
        _end(forced)
        self.proc.poll()
        _wait_gone(forced, 15)
        extra = self.after_stop()
        port_free = not _port_open(self.port)
        for _ in range(20):
            if port_free:
                break
            time.sleep(0.5)
            port_free = not _port_open(self.port)
        return {
            "stop_s": time.perf_counter() - t0,
            "killed_after_timeout": len(forced),
            "port_free": port_free,
            **extra,
        }

    def signal_stop(self) -> None:
        _end([self.proc.pid] + self.tree, signal.SIGTERM)

    def after_stop(self) -> Dict[str, Any]:
        return {}

    def kv(self) -> Dict[str, Any]:
        return {}


class VllmServer(Server):
    name = "vllm"

    def __init__(self, args, log_dir):
        super().__init__(args, log_dir)
        self.port = args.vllm_port

    def command(self) -> List[str]:
        if not self.args.model_dir:
            raise RuntimeError("vllm needs --model-dir (a config.json + tokenizer folder)")
        return [
            "bash",
            os.path.abspath(self.args.vllm_serve_script),
            os.path.abspath(self.args.model_dir),
            str(self.port),
            *shlex.split(self.args.vllm_args),
        ]

    def env(self) -> Dict[str, str]:
        return dict(super().env(), OUT=self.log_dir)  # the script logs to $OUT/vllm_server.log

    def detached(self) -> bool:
        return True

    def wait_ready(self, t0: float) -> None:
        try:
            self.proc.wait(timeout=self.args.start_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError("the vLLM serve script did not return") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"the vLLM serve script exited with {self.proc.returncode}")
        with open(os.path.join(self.log_dir, f"server_{self.name}.log")) as f:
            m = re.search(r"pid (\d+)", f.read())
        self.pid = int(m.group(1)) if m else None
        self.snapshot_tree()
        super().wait_ready(t0)

    def snapshot_tree(self) -> None:
        super().snapshot_tree()
        if self.pid:
            self.tree = sorted(set(self.tree) | {self.pid} | set(_descendants(self.pid)))


class ServingServer(Server):
    name = "serving"

    def __init__(self, args, log_dir, switch_interval: Optional[float] = None):
        super().__init__(args, log_dir)
        self.port = args.serving_port
        self.switch_interval = switch_interval
        if switch_interval is not None:
            self.name = "serving-switch"

    def serving_argv(self) -> List[str]:
        argv = ["--served-model-name", SERVED_NAME, "--port", str(self.port)]
        if self.args.model_dir:
            argv = ["--model", os.path.abspath(self.args.model_dir), "--load-format", "dummy"] + argv
        if any(server == "serving" for server, _ in pairs(self.args.torch_profile, "--torch-profile")):
            argv += ["--profile-dir", os.path.join(self.log_dir, "traces")]
        return argv + shlex.split(self.args.serving_args)

    def command(self) -> List[str]:
        if self.switch_interval is None:
            return [sys.executable, "-m", "serving", *self.serving_argv()]
        code = (
            f"import sys; sys.setswitchinterval({self.switch_interval!r}); import runpy; "
            f"sys.argv = ['serving'] + {self.serving_argv()!r}; runpy.run_module('serving', run_name='__main__')"
        )
        return [sys.executable, "-c", code]

    def env(self) -> Dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        return env

    def signal_stop(self) -> None:
        _end([self.proc.pid], signal.SIGINT)

    def kv(self) -> Dict[str, Any]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text

        def gauge(name: str) -> Optional[float]:
            m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            return float(m.group(1)) if m else None

        out: Dict[str, Any] = {
            "source": "/metrics",
            "running": gauge("radixserve_num_requests_running"),
            "waiting": gauge("radixserve_num_requests_waiting"),
            "kv_usage_ratio": gauge("radixserve_kv_cache_usage_ratio"),
        }
        for kind in ("total", "free", "evictable"):
            value = gauge(f"radixserve_kv_cache_{kind}_tokens")
            out[f"kv_{kind}_tokens"] = None if value is None else int(value)
        if None not in (out["kv_free_tokens"], out["kv_total_tokens"], out["kv_evictable_tokens"]):
            out["kv_no_leak"] = out["kv_free_tokens"] + out["kv_evictable_tokens"] == out["kv_total_tokens"]
        return out


def _cli(name: str, module: str, func: str) -> List[str]:
    """A console script beside this Python or on PATH, else its entry point through this Python
    (pip install --target leaves no scripts)."""
    import shutil

    path = os.path.join(os.path.dirname(sys.executable), name)
    path = path if os.path.exists(path) else shutil.which(name)
    if path:
        return [path]
    return [
        sys.executable,
        "-c",
        f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; sys.exit({func}())",
    ]


class ClusterServer(Server):
    name = "cluster"
    port = 8000

    def command(self) -> List[str]:
        argv = _cli("serve", "ray.serve.scripts", "cli") + [
            "run",
            "cluster.app:deployment",
            f"served_model_name={SERVED_NAME}",
        ]
        if self.args.model_dir:
            argv += [f"model={os.path.abspath(self.args.model_dir)}", "load_format=dummy"]
        return argv + shlex.split(self.args.cluster_args)

    def env(self) -> Dict[str, str]:
        from cluster.ingress.haproxy_launcher import binary_path_env

        env = dict(super().env(), RAY_SERVE_USE_GRPC_BY_DEFAULT="1", RAY_SERVE_ENABLE_HA_PROXY="1")
        env.update(binary_path_env(env))  # HAProxy's stats and exporter on 127.0.0.1, as deploy/serve.sh runs it
        env.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")  # deploy/serve.sh's default; set 0 to compare
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        return env

    def signal_stop(self) -> None:
        _end([self.proc.pid], signal.SIGINT)  # as Ctrl-C: Serve, the local Ray cluster and HAProxy shut down

    def after_stop(self) -> Dict[str, Any]:
        if not self.args.ray_stop:
            return {}
        cmd = _cli("ray", "ray.scripts.scripts", "main") + ["stop", "--force"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            return {"ray_stop": p.returncode}
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"ray_stop": str(exc)}

    def counters(self) -> Dict[str, float]:
        """The replicas' TTFT counters (bench_cluster.replica_counters): before and after a workload, their
        difference splits the workload's TTFT (ttft_split)."""
        from bench_cluster import replica_counters

        return replica_counters(self.base_url)

    def kv(self) -> Dict[str, Any]:
        stats = httpx.get(f"{self.base_url}/router/stats", timeout=10).json()
        workers = {}
        for wid, w in stats.get("workers", {}).items():
            e = w.get("engine", {})
            keys = (
                "kv_free_tokens",
                "kv_total_tokens",
                "kv_evictable_tokens",
                "kv_cached_tokens",
                "running",
                "waiting",
            )
            row = {k: e.get(k) for k in keys}
            if None not in (row["kv_free_tokens"], row["kv_total_tokens"], row["kv_evictable_tokens"]):
                row["kv_no_leak"] = row["kv_free_tokens"] + row["kv_evictable_tokens"] == row["kv_total_tokens"]
            workers[wid] = row
        out: Dict[str, Any] = {"source": "/router/stats", "workers": workers}
        flags = [w["kv_no_leak"] for w in workers.values() if "kv_no_leak" in w]
        if flags:
            out["kv_no_leak"] = all(flags)
        out["running"] = sum(w.get("running") or 0 for w in workers.values())
        out["waiting"] = sum(w.get("waiting") or 0 for w in workers.values())
        return out


def make_server(name: str, args, log_dir: str) -> Server:
    if name == "vllm":
        return VllmServer(args, log_dir)
    if name == "serving":
        return ServingServer(args, log_dir)
    if name == "serving-switch":
        return ServingServer(args, log_dir, switch_interval=args.switch_interval)
    if name == "cluster":
        return ClusterServer(args, log_dir)
    raise ValueError(name)


def _counters(server: Server) -> Optional[Dict[str, float]]:
    """The cluster's TTFT counters now (None for other servers, or when they cannot be read)."""
    if not isinstance(server, ClusterServer):
        return None
    try:
        return server.counters()
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def _ttft_split(server: "ClusterServer", before: Dict[str, float], summary: Dict[str, Any]) -> Dict[str, Any]:
    """One workload's mean TTFT split (ms): the ingress's routing call, its worker call to the first message
    with tokens, the worker's own call start to first output inside that, and the rest of the client's mean
    TTFT (HAProxy, HTTP, the serving layer and tokenization in the ingress)."""
    from bench_cluster import ttft_split

    try:
        split: Dict[str, Any] = ttft_split(before, server.counters())
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    ttft = summary["ttft_ms"]["mean"]
    split["client_ttft_mean_ms"] = ttft
    if split["route_rpc_ms"] is not None and split["first_message_ms"] is not None:
        split["rest_ms"] = ttft - split["route_rpc_ms"] - split["first_message_ms"]
    return split


def kv_when_idle(server: Server, timeout: float = 20.0) -> Dict[str, Any]:
    """The server's KV counters once it reports no running or waiting request (stats refresh lags)."""
    deadline = time.monotonic() + timeout
    kv: Dict[str, Any] = {}
    while True:
        try:
            kv = server.kv()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            kv = {"error": f"{type(exc).__name__}: {exc}"}
        idle = not kv.get("running") and not kv.get("waiting")
        if (idle and kv.get("kv_no_leak", True)) or time.monotonic() > deadline or "error" in kv:
            return kv
        time.sleep(1)


# --- one workload through the HTTP client --------------------------------------------------------


def client_args(argv: List[str], base_url: str):
    args = bs.build_parser().parse_args(argv + ["--base-url", base_url, "--model", SERVED_NAME])
    args.api_key = None
    return args


def run_workload(argv: List[str], base_url: str, timeout: float) -> Dict[str, Any]:
    args = client_args(argv, base_url)
    sessions = bs.make_workload(args)
    before = bs.server_cache_counters(base_url, None)
    start = host_probe.snapshot()

    async def go():
        return await asyncio.wait_for(bs.run_load(args, sessions), timeout)

    results, duration = asyncio.run(go())
    host_speed = host_probe.between(start, host_probe.snapshot())
    after = bs.server_cache_counters(base_url, None)
    summary = bs.summarize(results, duration, before, after)
    summary["host_speed"] = host_speed
    summary["prompt_tokens_mean"] = summary["prompt_tokens"] / summary["completed"] if summary["completed"] else 0
    summary["bench_serving_args"] = argv
    summary["timeline"] = bs.timeline(results)
    return summary


def warm_up(base_url: str, n: int) -> None:
    if n:
        args = client_args(
            [
                "--dataset",
                "random",
                "--num-prompts",
                str(n),
                "--input-len",
                "16",
                "--range-ratio",
                "0",
                "--output-len",
                "8",
                "--max-concurrency",
                str(n),
                "--seed",
                str(WARMUP_SEED),
            ]
            + COMMON,
            base_url,
        )
        asyncio.run(bs.run_load(args, bs.make_workload(args)))


# --- vllm bench serve cross-check ----------------------------------------------------------------


def crosscheck(
    args, server: Server, workload: str, ours: Dict[str, Any], counts: Dict[str, int], log_dir: str
) -> Dict[str, Any]:
    """`vllm bench serve` against `server` with the shape of `workload` (a random one), right after
    our client's run of it; both clients' figures and their ratios."""
    cargs = client_args(workload_argv(workload, counts, args.workload_args), server.base_url)
    if cargs.dataset != "random":
        return {"error": "the cross-check takes a random workload"}
    low = cargs.input_len * (1 - cargs.range_ratio)
    name = f"vllm_bench_{server.name}_{workload}.json"
    cmd = shlex.split(args.vllm_bench_cmd) + [
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        server.base_url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        os.path.abspath(args.model_dir or "."),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(cargs.input_len),
        "--random-output-len",
        str(cargs.output_len),
        "--random-range-ratio",
        str(cargs.range_ratio),
        "--num-prompts",
        str(cargs.num_prompts),
        "--max-concurrency",
        str(cargs.max_concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(cargs.seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        log_dir,
        "--result-filename",
        name,
    ]
    t0 = time.perf_counter()
    with open(os.path.join(log_dir, f"vllm_bench_{server.name}_{workload}.log"), "w") as log:
        # From /tmp, as vllm_serve.sh runs vLLM: the project root on sys.path shadows packages vLLM imports.
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp", timeout=args.crosscheck_timeout)
    out: Dict[str, Any] = {"command": shlex.join(cmd), "returncode": p.returncode, "wall_s": time.perf_counter() - t0}
    path = os.path.join(log_dir, name)
    if p.returncode != 0 or not os.path.exists(path):
        out["error"] = "vllm bench serve failed (see its log)"
        return out
    with open(path) as f:
        v = json.load(f)
    theirs = {
        "request_throughput": v["request_throughput"],
        "output_throughput_tok_s": v["output_throughput"],
        "ttft_ms.p50": v["median_ttft_ms"],
        "itl_ms.p50": v["median_itl_ms"],
        "tpot_ms.mean": v["mean_tpot_ms"],
        "completed": v["completed"],
        "failed": v.get("failed", 0),
        "prompt_tokens_mean": v["total_input_tokens"] / v["completed"] if v["completed"] else 0,
        "output_tokens": v["total_output_tokens"],
        "duration_s": v["duration"],
    }
    mine = {
        k: lookup(ours, k)
        for k in (
            "request_throughput",
            "output_throughput_tok_s",
            "ttft_ms.p50",
            "itl_ms.p50",
            "tpot_ms.mean",
            "prompt_tokens_mean",
            "completed",
        )
    }
    agreement = {}
    for key in ("request_throughput", "ttft_ms.p50", "itl_ms.p50", "tpot_ms.mean"):
        if mine.get(key) and theirs.get(key):
            r = mine[key] / theirs[key]
            agreement[key] = {"ours_over_vllm_client": r, "within_5pct": abs(r - 1) <= 0.05}
    out.update(
        ours=mine,
        vllm_bench_serve=theirs,
        agreement=agreement,
        prompt_tokens_note=(
            f"our prompts: {cargs.input_len} words (range {low:.0f}-{cargs.input_len}), "
            f"{mine['prompt_tokens_mean']:.1f} tokens on average as the server counted; "
            f"vLLM's random dataset: {cargs.input_len} random token ids decoded to text, "
            f"{theirs['prompt_tokens_mean']:.1f} tokens on average as the server counted"
        ),
    )
    return out


# --- py-spy profile of a server during one workload ----------------------------------------------


def profile(args, server: Server, workload: str, counts: Dict[str, int], log_dir: str) -> Dict[str, Any]:
    pid = server.pid
    if not pid or not args.py_spy:
        return {"error": "no py-spy (--py-spy) or no server pid"}
    # Its own prompts (another seed): the measured run's are in the server's prefix cache now.
    argv = workload_argv(workload, counts, args.workload_args) + ["--seed", str(100 + workload_seed(workload))]
    tag = f"{server.name}_{workload}"
    records = []
    for kind, extra in (("threads", ["--threads"]), ("gil", ["--gil"])):
        path = os.path.join(log_dir, f"pyspy_{tag}_{kind}.txt")
        cmd = [
            args.py_spy,
            "record",
            "--pid",
            str(pid),
            "-r",
            str(args.py_spy_rate),
            "-d",
            str(args.py_spy_duration),
            "--nonblocking",
            "--format",
            "raw",
            "-o",
            path,
            *extra,
        ]
        log = open(os.path.join(log_dir, f"pyspy_{tag}_{kind}.log"), "w")
        records.append((kind, path, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), cmd))
    out: Dict[str, Any] = {"workload": workload, "pid": pid, "commands": [shlex.join(r[3]) for r in records]}
    t, result = _run_in_background(args, server, argv)
    time.sleep(min(5.0, args.py_spy_duration / 2))
    dump = subprocess.run([args.py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    with open(os.path.join(log_dir, f"pyspy_{tag}_dump.txt"), "w") as f:
        f.write(dump.stdout + dump.stderr)
    out["dump_returncode"] = dump.returncode
    t.join()
    for kind, path, proc, _ in records:
        try:
            proc.wait(timeout=args.py_spy_duration + 60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        out[f"record_{kind}"] = {
            "returncode": proc.returncode,
            "file": os.path.basename(path),
            "exists": os.path.exists(path),
        }
    out["profiled_run"] = _summary_of(result)
    return out


def _run_in_background(args, server: Server, argv: List[str]) -> Tuple[Any, Dict[str, Any]]:
    """Start bench_serving's workload `argv` against `server` on a thread; its result dict fills in when
    it ends (`summary`, or `error`)."""
    import threading

    result: Dict[str, Any] = {}

    def load() -> None:
        try:
            result["summary"] = run_workload(argv, server.base_url, args.workload_timeout)
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=load)
    t.start()
    return t, result


def _summary_of(result: Dict[str, Any]) -> Dict[str, Any]:
    return {k: lookup(result["summary"], k) for k in SUMMARY_KEYS} if "summary" in result else result


# --- torch profiler trace of python -m serving's engine during one workload ---------------------


def torch_profile(args, server: Server, workload: str, counts: Dict[str, int]) -> Dict[str, Any]:
    """Run the workload once more (its own prompts) and, --torch-profile-delay s into it, record
    --torch-profile-steps engine steps (POST /start_profile); then where the device sat idle (trace_gaps.py)."""
    import httpx

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_gaps

    argv = workload_argv(workload, counts, args.workload_args) + ["--seed", str(200 + workload_seed(workload))]
    t, result = _run_in_background(args, server, argv)
    time.sleep(args.torch_profile_delay)
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        started = c.post("/start_profile", json={"num_steps": args.torch_profile_steps})
        started.raise_for_status()
        path = started.json()["trace"]
        t.join()
        if not os.path.exists(path):  # the workload ended before the steps ran out
            c.post("/stop_profile")
    out: Dict[str, Any] = {"workload": workload, "steps": args.torch_profile_steps, "trace": path}
    deadline = time.time() + 60
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.2)
    try:
        out["gaps"] = trace_gaps.analyze(trace_gaps.load_events(path))
    except ValueError as exc:  # no device events: a CPU server
        out["gaps"] = {"error": str(exc)}
    out["profiled_run"] = _summary_of(result)
    return out


# --- the bare engine (a child process, no HTTP) ---------------------------------------------------


def bare_child(spec_path: str) -> None:
    """Runs in its own process (--bare-child): one Engine, each workload of the spec through
    Engine.generate_stream under bench_serving's concurrency, a token event per output with new ids."""
    with open(spec_path) as f:
        spec = json.load(f)
    from engine import Engine
    from engine.config import EngineConfig
    import dataclasses

    from serving.__main__ import build_parser as serving_parser

    sargs = serving_parser().parse_args(spec["serving_argv"])
    opts = {f.name: getattr(sargs, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    t0 = time.perf_counter()
    engine = Engine(sargs.model, **opts)
    record: Dict[str, Any] = {"engine_load_s": time.perf_counter() - t0, "workloads": {}, "kv": {}, "errors": {}}
    try:
        engine.generate(["warm up"] * 4, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        for name, argv in spec["workloads"].items():
            args = client_args(argv, "http://unused")
            sessions = bs.make_workload(args)
            if any(len(s) != 1 for s in sessions):
                record["errors"][name] = "bare: single-turn workloads only"
                continue
            prompts = []
            for (turn,) in sessions:
                prompts.append(
                    turn.prompt
                    if turn.prompt is not None
                    else list(engine.tokenizer.apply_chat_template(turn.messages, add_generation_prompt=True))
                )
            params = {"temperature": args.temperature, "max_new_tokens": args.output_len, "ignore_eos": args.ignore_eos}

            async def main(prompts=prompts, params=params, args=args):
                sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
                results: List[bs.Result] = []

                async def go(p) -> bs.Result:
                    res = bs.Result(ok=False)
                    try:
                        async for ch in engine.generate_stream(p, params):
                            if ch.new_token_ids:
                                res.add_text(ch.text or "")
                            if ch.finish_reason is not None:
                                res.prompt_tokens, res.cached_tokens = ch.prompt_tokens, ch.cached_tokens
                                res.output_tokens = ch.completion_tokens
                    except Exception as exc:  # noqa: BLE001
                        res.error = f"{type(exc).__name__}: {exc}"
                        return res
                    return res.finish()

                async def one(p) -> None:
                    if sem is None:
                        results.append(await go(p))
                    else:
                        async with sem:
                            results.append(await go(p))

                start = time.perf_counter()
                await asyncio.gather(*(one(p) for p in prompts))
                return results, time.perf_counter() - start

            results, duration = asyncio.run(main())
            summary = bs.summarize(results, duration, None, None)
            summary["prompt_tokens_mean"] = summary["prompt_tokens"] / max(1, summary["completed"])
            summary["bench_serving_args"] = argv
            record["workloads"][name] = summary
            st = engine.stats().as_dict()
            kv = {
                k: st.get(k)
                for k in (
                    "kv_free_tokens",
                    "kv_total_tokens",
                    "kv_evictable_tokens",
                    "kv_cached_tokens",
                    "running",
                    "waiting",
                )
            }
            kv["kv_no_leak"] = kv["kv_free_tokens"] + kv["kv_evictable_tokens"] == kv["kv_total_tokens"]
            record["kv"][name] = kv
            print(
                f"bare {name}: {summary['request_throughput']:.2f} req/s, ITL p50 {summary['itl_ms']['p50']:.2f} ms",
                flush=True,
            )
    finally:
        engine.shutdown()
    with open(spec["out"], "w") as f:
        json.dump(record, f)


def run_bare(args, workloads: List[str], counts: Dict[str, int], log_dir: str) -> Dict[str, Any]:
    serving_argv = ["--served-model-name", SERVED_NAME]
    if args.model_dir:
        serving_argv += ["--model", os.path.abspath(args.model_dir), "--load-format", "dummy"]
    serving_argv += shlex.split(args.serving_args)
    fd, out = tempfile.mkstemp(suffix=".json", dir=log_dir)
    os.close(fd)
    spec = {
        "serving_argv": serving_argv,
        "out": out,
        "workloads": {w: workload_argv(w, counts, args.workload_args) for w in workloads},
    }
    spec_path = out + ".spec"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    t0 = time.perf_counter()
    timeout = args.start_timeout + args.workload_timeout * len(workloads)
    with open(os.path.join(log_dir, "server_bare.log"), "w") as log:
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--bare-child", spec_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            timeout=timeout,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    run: Dict[str, Any] = {"returncode": p.returncode, "wall_s": time.perf_counter() - t0}
    try:
        with open(out) as f:
            child = json.load(f)
        run.update(
            started_s=child["engine_load_s"],
            workloads=child["workloads"],
            kv={w: v for w, v in child["kv"].items()},
            errors=child["errors"],
        )
    except (OSError, ValueError, KeyError):
        run["error"] = "the bare child wrote no result (see server_bare.log)"
    for path in (out, spec_path):
        try:
            os.remove(path)
        except OSError:
            pass
    return run


# --- main ---------------------------------------------------------------------------------------


def machine_info() -> Dict[str, Any]:
    """bench_offline.hardware() in a child process, so this process never creates a CUDA context."""
    code = "import json, sys; sys.path.insert(0, %r); import bench_offline; print(json.dumps(bench_offline.hardware()))"
    try:
        p = subprocess.run(
            [sys.executable, "-c", code % os.path.dirname(os.path.abspath(__file__))],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        hw = json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        hw = {"python": platform.python_version(), "cpu_count": str(os.cpu_count())}
    hw["host"] = platform.node()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            hw["boot_id"] = f.read().strip()
    except OSError:
        pass
    hw["http_stack"] = http_stacks()
    return hw


_HTTP_STACK = (
    "import importlib.util as u, json; print(json.dumps({'loop': 'uvloop' if u.find_spec('uvloop') else 'asyncio', "
    "'parser': 'httptools' if u.find_spec('httptools') else 'h11'}))"
)
"""What uvicorn's `auto` loop and parser resolve to in a Python environment (serving.server.http_stack)."""


PER_WORKLOAD = ("workloads", "kv", "stats_lines", "ttft_split_ms", "repeats", "errors")
"""The tables of a server's run keyed by workload."""


def kept_from_earlier_run(previous: Dict[str, Any], workloads: List[str]) -> Dict[str, Any]:
    """What a --merge run of a server keeps from that server's run in the JSON it merges into: each
    per-workload table's entries for the workloads this run does not measure, and `earlier_starts` (each
    earlier start of the server: when it was measured, how long it took to start and to stop, its workloads),
    so that one JSON gathers a server's workloads from several commands, each a start of its own."""
    kept: Dict[str, Any] = {}
    for key in PER_WORKLOAD:
        entries = {w: v for w, v in previous.get(key, {}).items() if w not in workloads}
        if entries:
            kept[key] = entries
    start = {k: previous.get(k) for k in ("measured_at", "started_s", "stop")}
    start["workloads"] = previous.get("measured", list(previous.get("workloads", {})))
    kept["earlier_starts"] = list(previous.get("earlier_starts", [])) + [start]
    return kept


def merged_http_stacks(previous: Dict[str, Any], current: Dict[str, Any], servers: List[str]) -> Dict[str, Any]:
    """The HTTP stacks a merged JSON names: this run's for the sides it measures ("vllm" for vLLM's server,
    "radixserve" for ours), the earlier run's for a side only that run measured."""
    measured = {"vllm" if name == "vllm" else "radixserve" for name in servers}
    kept = {side: stack for side, stack in previous.items() if side not in measured}
    return {**current, **kept}


def http_stacks() -> Dict[str, Any]:
    """The uvicorn loop and parser of our servers' environment and of vLLM's (VLLM_PYTHON, VLLM_PYTHONPATH):
    a pure-Python fallback on one side only would skew the comparison."""
    envs = {
        "radixserve": ([sys.executable], dict(os.environ)),
        "vllm": (
            [os.environ.get("VLLM_PYTHON", "python3")],
            {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            | {"PYTHONPATH": os.environ.get("VLLM_PYTHONPATH", "")},
        ),
    }
    out: Dict[str, Any] = {}
    for name, (python, env) in envs.items():
        try:
            p = subprocess.run(
                python + ["-c", _HTTP_STACK], capture_output=True, text=True, timeout=60, env=env, cwd="/"
            )
            out[name] = json.loads(p.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            out[name] = {"error": repr(exc)}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-dir",
        default=".gpu-model/llama-3.1-8b",
        help="config.json + tokenizer folder, served on dummy weights; '' = the default model (real weights, no vllm)",
    )
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=["vllm", "serving", "cluster"])
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=list(WORKLOADS),
        default=["random-1", "random-8", "random-64", "random-256", "shared-prefix", "multi-turn"],
    )
    p.add_argument(
        "--count",
        nargs="*",
        default=[],
        metavar="WORKLOAD=N",
        help="workload sizes (random: requests, shared-prefix: groups, multi-turn: conversations)",
    )
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each workload on each server, back to back, each with new prompts; the table, the ratios "
        "and the JSON's summary are the run of median req/s, `repeats` in the JSON lists every run",
    )
    p.add_argument(
        "--vllm-serve-script",
        default=os.path.join(ROOT, "benchmarks", "vllm_serve.sh"),
        help="the script that starts vLLM's server: SCRIPT MODEL_DIR PORT [flags] (vllm_serve.sh: set "
        "VLLM_PYTHONPATH where vLLM is installed apart)",
    )
    p.add_argument("--vllm-args", default="", help="extra flags of vLLM's server")
    p.add_argument("--serving-args", default="", help="extra flags of python -m serving (also the bare engine's)")
    p.add_argument("--cluster-args", default="", help="extra key=value ClusterArgs of serve run")
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--serving-port", type=int, default=8200)
    p.add_argument("--switch-interval", type=float, default=0.0002, help="serving-switch: sys.setswitchinterval")
    p.add_argument(
        "--ray-stop",
        action="store_true",
        help="cluster: `ray stop --force` after stopping (ends EVERY Ray process of the machine)",
    )
    p.add_argument(
        "--engine-tpot",
        action="store_true",
        help="first measure the engine alone (bench_decode.py --engine-tpot, the random-1 shape) and report each "
        "endpoint's random-1 TPOT over it",
    )
    p.add_argument("--crosscheck", nargs="*", default=[], metavar="SERVER:WORKLOAD")
    p.add_argument(
        "--vllm-bench-cmd",
        default=shlex.join(
            ["env", "-u", "PYTHONPATH", "PYTHONPATH=" + os.environ.get("VLLM_PYTHONPATH", "")]
            + [os.environ.get("VLLM_PYTHON", "python3"), "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
        ),
    )
    p.add_argument("--crosscheck-timeout", type=float, default=300)
    p.add_argument("--profile", nargs="*", default=[], metavar="SERVER:WORKLOAD")
    p.add_argument("--py-spy", default=None, help="py-spy binary (for --profile)")
    p.add_argument(
        "--torch-profile",
        nargs="*",
        default=[],
        metavar="serving:WORKLOAD",
        help="after that workload's measured run, run it again with a torch profiler trace of the engine "
        "(python -m serving --profile-dir), and report where the device sat idle (trace_gaps.py)",
    )
    p.add_argument("--torch-profile-delay", type=float, default=3.0, help="seconds into the run to start")
    p.add_argument("--torch-profile-steps", type=int, default=300, help="engine steps to record")
    p.add_argument("--py-spy-rate", type=int, default=200)
    p.add_argument("--py-spy-duration", type=int, default=15)
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--stop-timeout", type=float, default=60)
    p.add_argument("--workload-timeout", type=float, default=240, help="seconds for one workload's client run")
    p.add_argument("--log-dir", default=None, help="server logs, vllm bench results, profiles (default: a temp dir)")
    p.add_argument("--label", default="")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep what an existing --out JSON holds that this run does not measure (servers, a server's other"
        " workloads)",
    )
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/online_<GPU or cpu>.json)")
    p.add_argument("--bare-child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    if args.bare_child:
        return bare_child(args.bare_child)
    args.workload_args = extra
    counts = parse_counts(args.count)

    def terminate(signum, frame):  # `timeout` (SIGTERM): stop the running server, keep what was measured
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    checks, profiles = pairs(args.crosscheck, "--crosscheck"), pairs(args.profile, "--profile")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    torch_profiles = pairs(args.torch_profile, "--torch-profile")
    if any(server != "serving" for server, _ in torch_profiles):
        raise SystemExit("--torch-profile: only python -m serving records engine traces (serving:WORKLOAD)")
    log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="bench-online-"))
    os.makedirs(log_dir, exist_ok=True)
    hw = machine_info()
    print(
        "HTTP loop / parser: "
        + ", ".join(f"{k} {v.get('loop')} / {v.get('parser')}" for k, v in hw["http_stack"].items())
    )
    out = result_path(args.out, "online", hw)
    record: Dict[str, Any] = {}
    if args.merge and os.path.exists(out):
        with open(out) as f:
            record = json.load(f)
        hw["http_stack"] = merged_http_stacks(
            record.get("hardware", {}).get("http_stack", {}), hw["http_stack"], args.servers
        )
    record.update(
        benchmark="bench_online",
        hardware=hw,
        label=args.label,
        model=os.path.basename(os.path.normpath(args.model_dir)) + " (dummy weights)"
        if args.model_dir
        else "default model",
    )
    record.setdefault("settings", {})
    record["settings"][time.strftime("%Y-%m-%dT%H:%M:%S%z")] = {
        "argv": argv,
        "workload_args": extra,
        "servers": args.servers,
        "workloads": {w: workload_argv(w, counts, extra) for w in args.workloads},
        "caveat": "servers are not restarted between workloads: prefix caches persist across workloads "
        "(each workload has its own seed, so its prompts are new to the cache; this favours no server)",
    }
    runs = record.setdefault("runs", {})
    record.setdefault("crosscheck", {})
    record.setdefault("profiles", {})
    print(f"logs in {log_dir}; results to {out}", flush=True)

    def save() -> None:
        record["ratios_to_vllm"] = ratios(runs)
        record["tpot_endpoint_over_engine"] = endpoint_over_engine(record)
        with open(out, "w") as f:
            json.dump(record, f, indent=1)

    if args.engine_tpot:
        print("\n=== engine alone (batch-1 TPOT) ===", flush=True)
        try:
            record["engine_tpot"] = engine_tpot(args.model_dir, log_dir, args.start_timeout)
            print(f"engine alone: {record['engine_tpot']['tpot_ms']:.3f} ms per output token", flush=True)
        except Exception as exc:  # noqa: BLE001 - the servers still run
            record["engine_tpot"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"engine alone: {record['engine_tpot']['error']}", flush=True)
        save()

    for name in args.servers:
        print(f"\n=== {name} ===", flush=True)
        if name == "bare":
            runs[name] = dict(
                run_bare(args, args.workloads, counts, log_dir),
                host=hw.get("host"),
                boot_id=hw.get("boot_id"),
                measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            )
            save()
            continue
        server = make_server(name, args, log_dir)
        run: Dict[str, Any] = {
            "workloads": {},
            "kv": {},
            "measured": list(args.workloads),  # by this start (`workloads` also holds those --merge keeps)
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": hw.get("host"),
            "boot_id": hw.get("boot_id"),
        }
        if name in runs:  # --merge: this server's earlier run in the JSON
            run.update(kept_from_earlier_run(runs[name], args.workloads))
        runs[name] = run
        if isinstance(server, ClusterServer):  # Serve's switches the cluster ran with (deploy/serve.sh's defaults)
            run["serve_env"] = {k: v for k, v in sorted(server.env().items()) if k.startswith("RAY_SERVE_")}
        try:
            server.start()
            run["started_s"] = server.started_s
            print(f"{name} answered after {server.started_s:.0f} s", flush=True)
            warm_up(server.base_url, args.warmup_requests)
            for w in args.workloads:
                runs_of_w: List[Tuple[Dict[str, Any], List[str], Optional[Dict[str, Any]]]] = []
                for k in range(args.repeat):
                    wargv = workload_argv(w, counts, extra, k)
                    before = _counters(server)
                    try:
                        s = run_workload(wargv, server.base_url, args.workload_timeout)
                    except Exception as exc:  # noqa: BLE001 - record and go on to the next workload
                        run.setdefault("errors", {})[w] = f"{type(exc).__name__}: {exc}"
                        print(f"{name} {w}: {run['errors'][w]}", flush=True)
                        break
                    print(
                        f"{name} {w}{f' (run {k + 1} of {args.repeat})' if args.repeat > 1 else ''}: "
                        f"{s['request_throughput']:.2f} req/s, TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
                        f"ITL p50 {s['itl_ms']['p50']:.2f} ms, TPOT {s['tpot_ms']['mean']:.2f} ms, "
                        f"events/token {s['events_per_output_token']:.2f}, failed {s['failed']}; "
                        f"host {json.dumps(s['host_speed'])}",
                        flush=True,
                    )
                    split = None
                    if before is not None:
                        split = _ttft_split(server, before, s)
                        print(f"{name} {w}: TTFT mean split (ms) {json.dumps(split)}", flush=True)
                    if name in RADIXSERVE:
                        # a page leaked by any run is still missing after the last one: its check covers all
                        run["kv"][w] = kv_when_idle(server)
                        # the stats lines the server logged during this workload (the cluster: if Ray forwards them)
                        run.setdefault("stats_lines", {}).setdefault(w, []).extend(server.new_stats_lines())
                    runs_of_w.append((s, wargv, split))
                if not runs_of_w:
                    continue
                chosen = median_run([r[0] for r in runs_of_w])
                s, _, split = runs_of_w[chosen]
                run["workloads"][w] = s
                if split is not None:
                    run.setdefault("ttft_split_ms", {})[w] = split
                if args.repeat > 1:
                    run.setdefault("repeats", {})[w] = {
                        "median_run": chosen,
                        "runs": [repeat_figures(summary, wargv) for summary, wargv, _ in runs_of_w],
                    }
                if (name, w) in checks:
                    key = f"{name}:{w}"
                    try:
                        record["crosscheck"][key] = crosscheck(args, server, w, s, counts, log_dir)
                    except Exception as exc:  # noqa: BLE001
                        record["crosscheck"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                    result = record["crosscheck"][key]
                    print(f"crosscheck {key}: {json.dumps(result.get('agreement') or result.get('error'))}", flush=True)
                if (name, w) in profiles:
                    key = f"{name}:{w}"
                    try:
                        record["profiles"][key] = profile(args, server, w, counts, log_dir)
                    except Exception as exc:  # noqa: BLE001
                        record["profiles"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                if (name, w) in torch_profiles:
                    key = f"{name}:{w}"
                    try:
                        traced = torch_profile(args, server, w, counts)
                        record.setdefault("torch_profiles", {})[key] = traced
                        gaps = {k: v for k, v in traced["gaps"].items() if k != "largest_gaps"}
                        print(f"torch profile {key}: {json.dumps(gaps)}", flush=True)
                    except Exception as exc:  # noqa: BLE001
                        record.setdefault("torch_profiles", {})[key] = {"error": f"{type(exc).__name__}: {exc}"}
                save()
        except Exception as exc:  # noqa: BLE001 - a server that fails to start leaves the others to run
            run["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: {run['error']}", flush=True)
        finally:
            run["stop"] = server.stop()
            print(f"{name} stopped: {run['stop']}", flush=True)
            save()

    save()
    print()
    print(table(record))
    for server, r in ordered(runs).items():
        for w, rep in r.get("repeats", {}).items():
            rates = ", ".join(f"{x['request_throughput']:.2f}" for x in rep["runs"])
            print(f"repeats {server} {w}: req/s {rates} (the table: run {rep['median_run'] + 1}, the median)")
    for key, c in record["crosscheck"].items():
        if "agreement" in c:
            print(
                f"crosscheck {key} (ours / vllm bench serve): "
                + ", ".join(
                    f"{k} {v['ours_over_vllm_client']:.3f}{'' if v['within_5pct'] else ' (>5%)'}"
                    for k, v in c["agreement"].items()
                )
            )
    if record.get("tpot_endpoint_over_engine"):
        print(
            f"random-1 TPOT over the engine alone ({record['engine_tpot']['tpot_ms']:.3f} ms): "
            + ", ".join(f"{k} {v:.3f}" for k, v in record["tpot_endpoint_over_engine"].items())
        )
    leaks = {f"{s}:{w}": kv.get("kv_no_leak") for s, r in runs.items() for w, kv in r.get("kv", {}).items()}
    if leaks:
        print("KV free + evictable == total after each workload: " + ", ".join(f"{k} {v}" for k, v in leaks.items()))
    print(f"wrote {out}")
    png = plot(record, os.path.splitext(out)[0] + ".png")
    if png:
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
