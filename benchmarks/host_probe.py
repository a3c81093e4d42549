"""How fast the host CPU runs Python at a moment, and how much CPU time the hypervisor took over a stretch.

On a virtual machine the same code's host time can change between processes, and within one, for
stretches of seconds, whatever the code does. A benchmark row whose host was slow then reads as a slower
step. So the GPU benchmarks record, beside each row or run:

    probe_us   the time of a fixed pure-Python workload (dict stores and loads, integer adds: what a
               scheduler's and a kernel launcher's Python does), the median of PROBE_TRIALS; on one
               machine a larger value means a slower CPU at that moment, comparable within a JSON only
    steal_pct  the share of all CPUs' time the hypervisor gave to other guests over the stretch
               (/proc/stat's steal column; None where the kernel does not report it)

Both cost a few milliseconds and start no thread. Linux only for steal; the probe runs anywhere.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Dict, Optional

PROBE_LOOPS = 20_000
PROBE_TRIALS = 5
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _work(n: int) -> int:
    table: Dict[int, int] = {}
    total = 0
    for i in range(n):
        table[i & 255] = i
        total += table[i & 255]
    return total


def probe_us(loops: int = PROBE_LOOPS, trials: int = PROBE_TRIALS) -> float:
    """The median time of `trials` runs of the fixed workload, in microseconds."""
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        _work(loops)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def cpu_times(path: str = "/proc/stat") -> Optional[Dict[str, int]]:
    """All CPUs' time in clock ticks since boot by kind (`_CPU_FIELDS`), from /proc/stat's first line; None
    where the file is missing or has no steal column."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 1 + len(_CPU_FIELDS):
        return None
    return dict(zip(_CPU_FIELDS, (int(x) for x in first[1 : 1 + len(_CPU_FIELDS)])))


def steal_pct(before: Optional[Dict[str, int]], after: Optional[Dict[str, int]]) -> Optional[float]:
    """Steal over all CPU time between two `cpu_times`, in percent; None without both or with no time between."""
    if before is None or after is None:
        return None
    total = sum(after[k] - before[k] for k in _CPU_FIELDS)
    return 100.0 * (after["steal"] - before["steal"]) / total if total > 0 else None


@dataclass(frozen=True)
class Snapshot:
    probe_us: float
    cpu: Optional[Dict[str, int]]


def snapshot() -> Snapshot:
    return Snapshot(probe_us(), cpu_times())


def between(start: Snapshot, end: Snapshot) -> Dict[str, Optional[float]]:
    """What a JSON row keeps of a stretch: the probe at both ends and the steal in between."""
    return dict(
        probe_us_before=round(start.probe_us, 1),
        probe_us_after=round(end.probe_us, 1),
        steal_pct=None if (s := steal_pct(start.cpu, end.cpu)) is None else round(s, 2),
    )
