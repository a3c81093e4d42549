"""Interleaved A/B of whole steps: `bench_decode.py` (decode steps) or, with `--bench mixed`,
`bench_mixed_step.py` (prefill and mixed steps) on several source trees (arms), round after round.

A change to a kernel moves a decode step by a percent or less, about what one GPU differs from the next and
one minute from the next. So every arm runs on the same GPU in the same lease, arms interleaved within each
round (base, A, B, base, A, B, ...), each run a fresh benchmark process of its own tree, and the
table compares each arm's mean device time per step with the first arm's (mixed steps: the host's time to
enqueue one as well, since small ones are near the host's bound).

An arm is NAME, NAME=PATCH or NAME=PATCH:FLAGS:
  NAME             the source tree (--source, default this repository) as it is; the first arm is the
                   baseline of the ratios
  NAME=PATCH       a copy of the source tree with PATCH applied (`git diff` output; `git apply`, else `patch -p1`),
                   made once under --trees-dir; its own benchmark and engine run
  NAME=:FLAGS      the source tree with extra benchmark flags (quoted), e.g. "fast=:--gemv-rows-prefetch 2";
                   leading VAR=VALUE words set that arm's environment, e.g. "one=:OMP_NUM_THREADS=1"
  NAME=PATCH:FLAGS both
Arguments after `--` go to every run (e.g. `-- --batch-sizes 1 8 16 --context-len 1152`).

Writes one JSON (--out; default benchmarks/results/decode-ab_<model>_<gpu>.json, mixed-ab_... with
--bench mixed) with every run's rows (decode: batch size, step_ms, gpu_ms, roofline_ms; mixed: decodes,
prefill, gpu_ms, host_ms, wall_ms, cuda_graph, host_speed), the arms and their patches' SHA-256, and prints per row
each arm's gpu_ms (mixed: and host_ms) per round and the ratio of its mean to the first arm's.

  python benchmarks/ab_decode.py --arm base --arm gated=gated.patch --rounds 2 \\
      -- --batch-sizes 1 2 4 8 16 --context-len 1152
  python benchmarks/ab_decode.py --bench mixed --arm base --arm copies=copies.patch --rounds 2 \\
      -- --decodes 8 64 --prefill 0 64 128 256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import re
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "benchmarks", "configs", "llama-3.1-8b.json")  # bench_decode.py's default
SKIP = {".git", ".venv", "__pycache__", "results"}
"""Names not copied into an arm's tree: version control, environments, caches and benchmarks/results."""


class Bench(NamedTuple):
    script: str
    key: Tuple[str, ...]  # the fields that name a row (a step's shape)
    fields: Tuple[str, ...]  # the fields kept from each row
    metrics: Tuple[str, ...]  # the fields the table compares, each in a block of its own
    prefix: str  # of the default JSON name
    optional: Tuple[str, ...] = ()  # fields kept where a row has them (an arm's older tree may not write them)


BENCHES = {
    "decode": Bench("bench_decode.py", ("batch_size",), ("step_ms", "gpu_ms", "roofline_ms"), ("gpu_ms",), "decode-ab"),
    "mixed": Bench(
        "bench_mixed_step.py",
        ("decodes", "prefill"),
        ("gpu_ms", "host_ms", "wall_ms", "cuda_graph"),
        ("gpu_ms", "host_ms"),
        "mixed-ab",
        ("host_speed",),
    ),
}

_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


class Arm(NamedTuple):
    name: str
    patch: Optional[str]  # path of a patch to apply to a copy of this tree; None: this tree
    flags: List[str]  # extra benchmark flags
    env: Dict[str, str]  # extra environment of this arm's runs


def parse_arm(spec: str) -> Arm:
    """NAME[=[PATCH][:FLAGS]] -> Arm (FLAGS' leading VAR=VALUE words: the arm's environment); ValueError on an
    empty name or a missing patch file."""
    name, _, rest = spec.partition("=")
    patch, _, flags = rest.partition(":")
    if not name:
        raise ValueError(f"--arm {spec!r}: empty name")
    if patch and not os.path.isfile(patch):
        raise ValueError(f"--arm {spec!r}: no patch file {patch!r}")
    words = shlex.split(flags)
    env: Dict[str, str] = {}
    while words and _ENV_WORD.match(words[0]):
        var, _, value = words.pop(0).partition("=")
        env[var] = value
    return Arm(name, os.path.abspath(patch) if patch else None, words, env)


def make_tree(source: str, patch: str, dest: str) -> str:
    """A copy of `source` at `dest` (hidden folders, SKIP and benchmarks/results left out) with `patch`
    applied; returns dest. Raises CalledProcessError when the patch does not apply."""
    if os.path.exists(dest):
        shutil.rmtree(dest)

    def ignore(folder: str, names: List[str]) -> List[str]:
        return [n for n in names if n in SKIP or (n.startswith(".") and os.path.isdir(os.path.join(folder, n)))]

    shutil.copytree(source, dest, ignore=ignore, symlinks=True)
    # git apply inside an enclosing repository would patch paths relative to that repository's root
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(os.path.abspath(dest)))
    try:
        subprocess.run(["git", "apply", patch], cwd=dest, env=env, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        with open(patch, "rb") as f:
            subprocess.run(["patch", "-p1", "-s"], cwd=dest, stdin=f, check=True)
    return dest


_TITLES = {"gpu_ms": "device time per step (ms)", "host_ms": "host time to enqueue a step (ms)"}


def _label(bench: Bench, key: tuple) -> str:
    if bench.key == ("batch_size",):
        return f"batch {key[0]:>3}"
    return " + ".join(str(k) for k in key)


def summarize(runs: List[Dict], arms: List[str], bench: Bench = BENCHES["decode"]) -> List[str]:
    """Table lines: per metric and row, each arm's value per round and its mean over the first arm's mean."""
    lines: List[str] = []
    for metric in bench.metrics:
        by: Dict[tuple, List[float]] = {}
        for run in runs:
            for row in run["results"]:
                by.setdefault((run["arm"], tuple(row[k] for k in bench.key)), []).append(row[metric])
        keys = sorted({key for _, key in by})
        lines.append(f"{_TITLES.get(metric, metric)} per round, and the mean over {arms[0]}'s")
        for key in keys:
            base = by.get((arms[0], key))
            cells = []
            for arm in arms:
                times = by.get((arm, key))
                if not times:
                    cells.append(f"{arm}: -")
                    continue
                ratio = f" ({sum(times) / len(times) / (sum(base) / len(base)):.3f})" if base else ""
                cells.append(f"{arm}: " + " / ".join(f"{t:.3f}" for t in times) + ratio)
            lines.append(f"{_label(bench, key)}  " + "  ".join(cells))
    return lines


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main() -> None:
    argv = sys.argv[1:]
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", required=True, help="NAME, NAME=PATCH, NAME=:FLAGS or NAME=PATCH:FLAGS")
    p.add_argument(
        "--bench", choices=sorted(BENCHES), default="decode", help="decode: bench_decode.py; mixed: bench_mixed_step.py"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--source", default=ROOT, help="the tree the arms run or copy (default: this repository)")
    p.add_argument("--trees-dir", default=None, help="where patched copies go (default: a temp dir, removed after)")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds for one benchmark run")
    p.add_argument("--note", default="", help="recorded in the JSON")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in args.arm]
    except ValueError as e:
        sys.exit(str(e))
    if len({a.name for a in arms}) != len(arms):
        sys.exit("--arm: names must differ")
    bench = BENCHES[args.bench]

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_offline import hardware, result_path

    trees_dir = args.trees_dir or tempfile.mkdtemp(prefix="ab-decode-")
    scratch = tempfile.mkdtemp(prefix="ab-decode-json-")
    source = os.path.abspath(args.source)
    trees = {a.name: make_tree(source, a.patch, os.path.join(trees_dir, a.name)) if a.patch else source for a in arms}
    runs: List[Dict] = []
    failed: List[str] = []
    try:
        for r in range(1, args.rounds + 1):
            for arm in arms:
                tree = trees[arm.name]
                out = os.path.join(scratch, f"{arm.name}-r{r}.json")
                cmd = [sys.executable, os.path.join(tree, "benchmarks", bench.script), *extra, *arm.flags]
                path = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
                env = dict(os.environ, PYTHONPATH=path, **arm.env)
                t0 = time.time()
                done = subprocess.run(
                    [*cmd, "--out", out], cwd=tree, env=env, capture_output=True, text=True, timeout=args.run_timeout
                )
                if done.returncode != 0 or not os.path.exists(out):
                    failed.append(f"{arm.name} r{r}")
                    print(f"{arm.name} round {r} failed (rc {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
                    continue
                with open(out) as f:
                    record = json.load(f)
                rows = [
                    {k: row[k] for k in bench.key + bench.fields} | {k: row[k] for k in bench.optional if k in row}
                    for row in record.get("results", record.get("rows"))
                ]
                runs.append(dict(arm=arm.name, round=r, seconds=time.time() - t0, results=rows))
                shapes = (_label(bench, tuple(x[k] for k in bench.key)).strip() for x in rows)
                print(f"{arm.name} round {r}: " + ", ".join(f"{s}: {x['gpu_ms']:.3f}" for s, x in zip(shapes, rows)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.trees_dir is None:
            shutil.rmtree(trees_dir, ignore_errors=True)
    names = [a.name for a in arms]
    lines = summarize(runs, names, bench)
    print("\n".join(lines))
    hw = hardware()
    config = extra[extra.index("--config") + 1] if "--config" in extra[:-1] else DEFAULT_CONFIG
    model = os.path.splitext(os.path.basename(config))[0]
    path = result_path(args.out, f"{bench.prefix}_{model}", hw)
    with open(path, "w") as f:
        json.dump(
            dict(
                benchmark="ab_decode",
                bench=bench.script,
                hardware=hw,
                model=model,
                bench_decode_args=extra,
                arms=[
                    dict(
                        name=a.name,
                        patch=os.path.basename(a.patch) if a.patch else None,
                        patch_sha256=sha256(a.patch) if a.patch else None,
                        flags=a.flags,
                        env=a.env,
                    )
                    for a in arms
                ],
                rounds=args.rounds,
                note=args.note,
                failed=failed,
                runs=runs,
                table=lines,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=1,
        )
    print(f"wrote {path}")
    if failed:
        sys.exit(f"failed runs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
