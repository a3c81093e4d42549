"""Interleaved A/B of whole decode steps: `bench_decode.py` on several source trees (arms), round after round.

A change to a kernel moves a decode step by a percent or less, about what one GPU differs from the next and
one minute from the next. So every arm runs on the same GPU in the same lease, arms interleaved within each
round (base, A, B, base, A, B, ...), each run a fresh `bench_decode.py` process of its own tree, and the
table compares each arm's mean device time per step with the first arm's.

An arm is NAME, NAME=PATCH or NAME=PATCH:FLAGS:
  NAME             the source tree (--source, default this repository) as it is; the first arm is the
                   baseline of the ratios
  NAME=PATCH       a copy of the source tree with PATCH applied (`git diff` output; `git apply`, else `patch -p1`),
                   made once under --trees-dir; its own bench_decode.py and engine run
  NAME=:FLAGS      the source tree with extra bench_decode flags (quoted), e.g. "fast=:--gemv-rows-prefetch 2"
  NAME=PATCH:FLAGS both
Arguments after `--` go to every run (e.g. `-- --batch-sizes 1 8 16 --context-len 1152`).

Writes one JSON (--out; default benchmarks/results/decode-ab_<model>_<gpu>.json) with every run's rows
(batch size, step_ms, gpu_ms, roofline_ms), the arms and their patches' SHA-256, and prints per batch size
each arm's gpu_ms per round and the ratio of its mean to the first arm's.

  python benchmarks/ab_decode.py --arm base --arm gated=gated.patch --rounds 2 \\
      -- --batch-sizes 1 2 4 8 16 --context-len 1152
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
import time
from typing import Dict, List, NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "benchmarks", "configs", "llama-3.1-8b.json")  # bench_decode.py's default
SKIP = {".git", ".venv", "__pycache__", "results"}
"""Names not copied into an arm's tree: version control, environments, caches and benchmarks/results."""


class Arm(NamedTuple):
    name: str
    patch: Optional[str]  # path of a patch to apply to a copy of this tree; None: this tree
    flags: List[str]  # extra bench_decode.py flags


def parse_arm(spec: str) -> Arm:
    """NAME[=[PATCH][:FLAGS]] -> Arm; ValueError on an empty name or a missing patch file."""
    name, _, rest = spec.partition("=")
    patch, _, flags = rest.partition(":")
    if not name:
        raise ValueError(f"--arm {spec!r}: empty name")
    if patch and not os.path.isfile(patch):
        raise ValueError(f"--arm {spec!r}: no patch file {patch!r}")
    return Arm(name, os.path.abspath(patch) if patch else None, shlex.split(flags))


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


def summarize(runs: List[Dict], arms: List[str]) -> List[str]:
    """Table lines: per batch size, each arm's gpu_ms per round and its mean over the first arm's mean."""
    by: Dict[tuple, List[float]] = {}
    for run in runs:
        for row in run["results"]:
            by.setdefault((run["arm"], row["batch_size"]), []).append(row["gpu_ms"])
    sizes = sorted({bs for _, bs in by})
    lines = [f"device time per step (ms) per round, and the mean over {arms[0]}'s"]
    for bs in sizes:
        base = by.get((arms[0], bs))
        cells = []
        for arm in arms:
            times = by.get((arm, bs))
            if not times:
                cells.append(f"{arm}: -")
                continue
            ratio = f" ({sum(times) / len(times) / (sum(base) / len(base)):.3f})" if base else ""
            cells.append(f"{arm}: " + " / ".join(f"{t:.3f}" for t in times) + ratio)
        lines.append(f"batch {bs:>3}  " + "  ".join(cells))
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
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--source", default=ROOT, help="the tree the arms run or copy (default: this repository)")
    p.add_argument("--trees-dir", default=None, help="where patched copies go (default: a temp dir, removed after)")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds for one bench_decode run")
    p.add_argument("--note", default="", help="recorded in the JSON")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in args.arm]
    except ValueError as e:
        sys.exit(str(e))
    if len({a.name for a in arms}) != len(arms):
        sys.exit("--arm: names must differ")

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
                cmd = [sys.executable, os.path.join(tree, "benchmarks", "bench_decode.py"), *extra, *arm.flags]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
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
                    {k: row[k] for k in ("batch_size", "step_ms", "gpu_ms", "roofline_ms")} for row in record["results"]
                ]
                runs.append(dict(arm=arm.name, round=r, seconds=time.time() - t0, results=rows))
                print(f"{arm.name} round {r}: " + ", ".join(f"{x['batch_size']}: {x['gpu_ms']:.3f}" for x in rows))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.trees_dir is None:
            shutil.rmtree(trees_dir, ignore_errors=True)
    names = [a.name for a in arms]
    lines = summarize(runs, names)
    print("\n".join(lines))
    hw = hardware()
    config = extra[extra.index("--config") + 1] if "--config" in extra[:-1] else DEFAULT_CONFIG
    model = os.path.splitext(os.path.basename(config))[0]
    path = result_path(args.out, f"decode-ab_{model}", hw)
    with open(path, "w") as f:
        json.dump(
            dict(
                benchmark="ab_decode",
                hardware=hw,
                model=model,
                bench_decode_args=extra,
                arms=[
                    dict(
                        name=a.name,
                        patch=os.path.basename(a.patch) if a.patch else None,
                        patch_sha256=sha256(a.patch) if a.patch else None,
                        flags=a.flags,
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
