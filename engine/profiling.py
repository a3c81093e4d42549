"""StepProfiler: a torch profiler trace of the scheduler's loop, started and stopped on request.

    Engine.start_profile(num_steps) ─▶ CoreCall ─▶ StepProfiler.start   (torch.profiler: CPU, + CUDA on a GPU)
    every loop iteration that did work ─▶ StepProfiler.after_step        (stops itself after num_steps)
    Engine.stop_profile()            ─▶ CoreCall ─▶ StepProfiler.stop    ─▶ the trace's path

A trace is a Chrome / Perfetto JSON file (gzip) in EngineConfig.profile_dir, named after the process and
the time it started: the host's work (Python, torch ops, kernel launches), the device's kernels, and the
scheduler's stages as named ranges (`label`): plan, prepare, launch, resolve, process. While no profile
runs, `label` is a no-op context, so the loop pays nothing for the names.

One profile at a time. The StepProfiler is owned by EngineCore (its loop thread); not thread-safe.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import ContextManager, Optional

import torch

_active = False
"""Whether a profile is recording (module-wide: the loop's stages ask it on every step)."""


def label(name: str) -> ContextManager:
    """A named range in the trace while a profile records; otherwise nothing."""
    return torch.profiler.record_function(name) if _active else contextlib.nullcontext()


class ProfileError(RuntimeError):
    """Profiling was asked for in a state that does not allow it (off, already running, not running)."""


class StepProfiler:
    def __init__(self, out_dir: str, device: torch.device):
        self.out_dir = out_dir
        self.device = device
        self._profile: Optional[torch.profiler.profile] = None
        self._steps_left: Optional[int] = None
        self._path = ""
        self.last_path: Optional[str] = None
        """The trace written last (by stop, or when num_steps ran out)."""

    def start(self, num_steps: Optional[int] = None) -> str:
        """Start recording; with `num_steps`, stop by itself after that many loop iterations with work.
        Returns the path the trace will be written to."""
        global _active
        if self._profile is not None:
            raise ProfileError("a profile is already recording: stop it first")
        if num_steps is not None and num_steps < 1:
            raise ProfileError(f"num_steps must be >= 1, got {num_steps}")
        os.makedirs(self.out_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._path = os.path.join(self.out_dir, f"engine-core-{os.getpid()}-{stamp}.trace.json.gz")
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        self._steps_left = num_steps
        _active = True
        return self._path

    def after_step(self) -> None:
        """One loop iteration with work is over: count it against num_steps."""
        if self._profile is None or self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()

    def stop(self) -> str:
        """Stop recording and write the trace; returns its path."""
        global _active
        if self._profile is None:
            last = f" (the last trace: {self.last_path})" if self.last_path else ""
            raise ProfileError(f"no profile is recording{last}")
        profile, self._profile, self._steps_left = self._profile, None, None
        _active = False
        profile.stop()
        profile.export_chrome_trace(self._path)
        self.last_path = self._path
        return self._path
