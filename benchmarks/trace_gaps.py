"""Where the device sat idle in a torch profiler trace of the engine (engine/profiling.py), and what the
scheduler's loop was doing meanwhile.

    python benchmarks/trace_gaps.py TRACE.trace.json.gz [--min-gap-us 20] [--top 15] [--json OUT]

The device's work is the union of its kernels, copies and memsets; an idle gap is the time between two
of them. Gaps of at least --min-gap-us are attributed to the loop's stages (the named ranges plan,
prepare, launch, resolve, process) that overlapped them on the host, by overlap time; what no stage
covered is "outside the stages" (the core handling messages, sending outputs, logging). Small gaps are
the launch latency between kernels and are only counted.

Two more views of the large gaps: whether the work that ended a gap was launched late (the host issued
its launch after the device had gone idle: the host is the bottleneck) or early (the device waited on
something else: a copy, an event, a sync); and which host ops the loop's thread was inside during the
gaps (the innermost `cpu_op` / `cuda_runtime` event, sampled every --sample-us). Prints the tables and
the largest gaps; --json writes the same as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
from bisect import bisect_left, bisect_right
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")
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


def _loop_thread(events: Sequence[Dict[str, Any]]) -> Optional[Tuple[Any, Any]]:
    """(pid, tid) of the scheduler's loop: the thread that recorded the most stage ranges."""
    threads = Counter(
        (e.get("pid"), e.get("tid"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in STAGES
    )
    return threads.most_common(1)[0][0] if threads else None


class _HostOps:
    """One thread's host events (torch ops, CUDA runtime calls), to ask which is innermost at an instant."""

    def __init__(self, events: Sequence[Dict[str, Any]], thread: Optional[Tuple[Any, Any]]):
        self.ops = sorted(
            (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
            for e in events
            if e.get("ph") == "X" and e.get("cat") in HOST_CATS and (e.get("pid"), e.get("tid")) == thread
        )
        self.starts = [op[0] for op in self.ops]
        self.longest = max((end - start for start, end, _ in self.ops), default=0.0)

    def innermost(self, t: float) -> Optional[str]:
        """The name of the shortest event covering instant t, or None."""
        best: Optional[Tuple[float, float, str]] = None
        for op in self.ops[bisect_left(self.starts, t - self.longest) : bisect_right(self.starts, t)]:
            if op[0] <= t < op[1] and (best is None or op[1] - op[0] < best[1] - best[0]):
                best = op
        return best[2] if best else None


def _launch_times(events: Sequence[Dict[str, Any]]) -> Dict[Any, float]:
    """The host time at which each correlation id's launch call (kernel, graph, copy) began."""
    return {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


def analyze(
    events: Sequence[Dict[str, Any]], min_gap_us: float = 20.0, top: int = 15, sample_us: float = 10.0
) -> Dict[str, Any]:
    """Device busy / idle time (µs) over the device's first to last event, and the idle gaps of at least
    `min_gap_us`: split by the loop stage that overlapped them on the host, by whether the work ending
    the gap was launched before or after the gap began, and by the host op the loop was in (sampled
    every `sample_us`)."""
    device_events = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    device = merge([(e["ts"], e["ts"] + e.get("dur", 0)) for e in device_events])
    if not device:
        raise ValueError("no device events in the trace (a CPU trace, or the profile recorded no step)")
    first_at: Dict[float, Dict[str, Any]] = {}
    for e in device_events:
        first_at.setdefault(e["ts"], e)
    launched = _launch_times(events)
    host = _HostOps(events, _loop_thread(events))
    host_ops: Counter = Counter()
    before_launch = 0.0
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
        nxt = first_at[gap[1]]
        launch = launched.get(nxt.get("args", {}).get("correlation"))
        late = None if launch is None else min(max(0.0, launch - gap[0]), gap[1] - gap[0])
        before_launch += late or 0.0
        t = gap[0]
        while t < gap[1]:
            host_ops[host.innermost(t) or "(no op)"] += min(sample_us, gap[1] - t)
            t += sample_us
        listed.append(
            dict(
                at_ms=round((gap[0] - device[0][0]) / 1e3, 3),
                idle_us=round(gap[1] - gap[0], 1),
                stages={s: round(us, 1) for s, us in covered.items() if us > 0},
                next=nxt.get("name", "")[:80],
                before_launch_us=None if late is None else round(late, 1),
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
        large_gap_idle_before_launch_ms=round(before_launch / 1e3, 3),
        large_gap_host_ops_ms={name: round(us / 1e3, 3) for name, us in host_ops.most_common(top)},
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
    before = r["large_gap_idle_before_launch_ms"]
    print(f"\nof the large gaps' idle time, {before:.2f} ms ({before / total:.1%}) passed before the host launched")
    print("the work that ended the gap (the rest: launch latency, or the device waiting on a copy / event)")
    print(f"\n{'innermost host op during the large gaps':60} {'ms':>9}")
    for name, ms in r["large_gap_host_ops_ms"].items():
        print(f"{name[:60]:60} {ms:9.2f}")
    print(f"\n{'largest gaps: at ms':20} {'idle us':>9} {'pre-launch':>10}  next on the device; host stages (us)")
    for g in r["largest_gaps"]:
        late = "?" if g["before_launch_us"] is None else f"{g['before_launch_us']:.1f}"
        print(f"{g['at_ms']:20.3f} {g['idle_us']:9.1f} {late:>10}  {g['next'][:40]}; {g['stages']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--sample-us", type=float, default=10.0, help="how often to ask which host op the loop is in")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = analyze(load_events(args.trace), args.min_gap_us, args.top, args.sample_us)
    report["trace"] = args.trace
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
