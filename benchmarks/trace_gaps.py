"""Where the device sat idle in a torch profiler trace of the engine (engine/profiling.py), and what the
scheduler's loop was doing meanwhile.

    python benchmarks/trace_gaps.py TRACE.trace.json.gz [--min-gap-us 20] [--top 15] [--json OUT]

The device's work is the union of its kernels, copies and memsets; an idle gap is the time between two
of them. Gaps of at least --min-gap-us are attributed to the loop's stages (the named ranges plan,
prepare, launch, resolve, process) that overlapped them on the host, by overlap time; what no stage
covered is "outside the stages" (the core handling messages, sending outputs, logging). Small gaps are
the launch latency between kernels and are only counted. Prints one table and the largest gaps; --json
writes the same as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
from typing import Any, Dict, List, Sequence, Tuple

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STAGES = ("plan", "prepare", "launch", "resolve", "process")
OUTSIDE = "outside the stages"

Interval = Tuple[float, float]


def load_events(path: str) -> List[Dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def merge(intervals: Sequence[Interval]) -> List[Interval]:
    """Sorted, non-overlapping union of [start, end) intervals."""
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a: Interval, b: Interval) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def analyze(events: Sequence[Dict[str, Any]], min_gap_us: float = 20.0, top: int = 15) -> Dict[str, Any]:
    """Device busy / idle time (µs) over the device's first to last event, and the idle gaps of at least
    `min_gap_us` split by the loop stage that overlapped them on the host."""
    device = merge(
        [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    )
    if not device:
        raise ValueError("no device events in the trace (a CPU trace, or the profile recorded no step)")
    stages: Dict[str, List[Interval]] = {s: [] for s in STAGES}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in stages:
            stages[e["name"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    stages = {s: merge(v) for s, v in stages.items()}
    window = device[-1][1] - device[0][0]
    busy = sum(end - start for start, end in device)
    gaps = [(a[1], b[0]) for a, b in zip(device, device[1:])]
    large = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    by_stage = dict.fromkeys((*STAGES, OUTSIDE), 0.0)
    listed = []
    for gap in large:
        covered = {s: sum(_overlap(gap, iv) for iv in ivs) for s, ivs in stages.items()}
        for s, us in covered.items():
            by_stage[s] += us
        by_stage[OUTSIDE] += max(0.0, (gap[1] - gap[0]) - sum(covered.values()))
        listed.append(
            dict(
                at_ms=round((gap[0] - device[0][0]) / 1e3, 3),
                idle_us=round(gap[1] - gap[0], 1),
                stages={s: round(us, 1) for s, us in covered.items() if us > 0},
            )
        )
    listed.sort(key=lambda g: -g["idle_us"])
    idle_large = sum(g[1] - g[0] for g in large)
    return dict(
        window_ms=round(window / 1e3, 3),
        device_busy_ms=round(busy / 1e3, 3),
        device_busy_share=round(busy / window, 4),
        idle_ms=round((window - busy) / 1e3, 3),
        min_gap_us=min_gap_us,
        large_gaps=len(large),
        large_gap_idle_ms=round(idle_large / 1e3, 3),
        small_gaps=len(gaps) - len(large),
        small_gap_idle_ms=round((window - busy - idle_large) / 1e3, 3),
        large_gap_idle_by_stage_ms={s: round(us / 1e3, 3) for s, us in by_stage.items()},
        largest_gaps=listed[:top],
    )


def print_report(r: Dict[str, Any]) -> None:
    print(f"device window {r['window_ms']:.1f} ms: busy {r['device_busy_ms']:.1f} ms ({r['device_busy_share']:.1%}),")
    print(
        f"  idle {r['idle_ms']:.1f} ms: {r['large_gaps']} gaps of >= {r['min_gap_us']:g} us"
        f" ({r['large_gap_idle_ms']:.1f} ms), {r['small_gaps']} smaller ({r['small_gap_idle_ms']:.1f} ms)"
    )
    print(f"\n{'host stage during the large gaps':36} {'ms':>9} {'share':>7}")
    total = max(r["large_gap_idle_ms"], 1e-9)
    for stage, ms in r["large_gap_idle_by_stage_ms"].items():
        print(f"{stage:36} {ms:9.2f} {ms / total:7.1%}")
    print(f"\n{'largest gaps: at ms':20} {'idle us':>9}  host stages (us)")
    for g in r["largest_gaps"]:
        print(f"{g['at_ms']:20.3f} {g['idle_us']:9.1f}  {g['stages']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = analyze(load_events(args.trace), args.min_gap_us, args.top)
    report["trace"] = args.trace
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
