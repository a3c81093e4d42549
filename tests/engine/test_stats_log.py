"""engine/core/stats_log.py: the periodic stats line of a busy engine (log_stats_interval_s)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from engine.config import EngineConfig
from engine.core.stats_log import StatsLog
from engine.errors import InvalidConfigError
from engine.outputs import EngineStats
from engine_harness import make_engine


def _stats(**counters) -> EngineStats:
    """An EngineStats with every counter 0, a few gauges set, then `counters`."""
    zero = dict.fromkeys((f.name for f in dataclasses.fields(EngineStats)), 0)
    return EngineStats(**{**zero, "running": 3, "waiting": 1, "kv_total_tokens": 1000, "kv_usage": 0.06, **counters})


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_busy_interval_with_the_interval_rates():
    clock = _Clock()
    log = StatsLog(10.0, clock)
    assert not log.due()
    clock.now += 300
    assert not log.due()  # idle: nothing to say
    clock.now += 0.020
    log.iteration(0.020)  # the engine gets work after 300 s idle: the interval starts with this iteration
    assert not log.due()
    clock.now = 420.0
    log.iteration(0.055)
    assert log.due()
    counts = dict(prompt_tokens=3000, cached_tokens=1000, generated_tokens=400, prefill_steps=2, decode_steps=8)
    first = _stats(**counts, device_wait_s=15.0)
    line = log.line(first)
    assert line == (
        "last 20.0 s: prompt 150 tok/s (cache hit 33.3%), generation 20 tok/s; running 3, waiting 1; KV 6.0% used; "
        "steps 10 (prefill 2, 0 of them mixed; decode 8); longest step 55.0 ms; waiting on the device 75%"
    )
    assert not log.due()  # the next iteration with work starts the next interval
    clock.now += 0.010
    log.iteration(0.010)
    clock.now = 430.0
    second = dataclasses.replace(
        first,
        prompt_tokens=4000,
        cached_tokens=1900,
        generated_tokens=900,
        prefill_steps=7,
        mixed_steps=5,
        decode_steps=28,
        device_wait_s=16.0,
        device_busy_s=9.5,
        device_gap_decode_s=0.1,
        device_gap_mixed_s=0.25,
    )
    line = log.line(second)  # rates, hit rate and device share of this interval only
    assert "last 10.0 s: prompt 100 tok/s (cache hit 90.0%), generation 50 tok/s" in line
    assert "steps 25 (prefill 5, 5 of them mixed; decode 20); longest step 10.0 ms; waiting on the device 10%" in line
    # a GPU's busy and idle shares; no such part when they did not move (the CPU)
    assert line.endswith("; device busy 95%, idle between steps 3.5% (before decode 1.0%, mixed 2.5%, prefill 0.0%)")


def test_interval_must_be_positive_and_config_bounds():
    with pytest.raises(ValueError, match="interval_s"):
        StatsLog(0)
    assert EngineConfig().log_stats_interval_s == 0
    with pytest.raises(InvalidConfigError, match="log_stats_interval_s"):
        EngineConfig(log_stats_interval_s=-1)


def test_servers_log_stats_by_default():
    from serving.__main__ import SERVER_DEFAULTS

    assert SERVER_DEFAULTS["log_stats_interval_s"] > 0


def test_a_busy_engine_logs_lines_and_an_idle_one_does_not(tmp_path, caplog):
    from engine_harness import write_tiny_config

    folder = write_tiny_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="engine.core.stats_log"):
        engine = make_engine(model=folder, load_format="dummy", skip_tokenizer_init=True, log_stats_interval_s=1e-6)
        try:
            engine.generate([[1, 2, 3, 4]] * 3, dict(temperature=0.0, max_new_tokens=8, ignore_eos=True))
            lines = [r.getMessage() for r in caplog.records if r.name == "engine.core.stats_log"]
            assert lines and all(line.startswith("last ") and "longest step" in line for line in lines)
            assert any("generation" in line and "decode" in line for line in lines)
            assert engine.stats().device_wait_s == 0.0  # the CPU forward runs on the host: nothing to wait for
            assert engine.stats().device_busy_s == 0.0  # and no device clock
            assert not any("device busy" in line for line in lines)
            engine.stats()  # the loop's last iteration with work (overlap: the final batch's results) is behind us
            caplog.clear()
            engine.stats()  # an idle loop handles a call: no work, no line
            assert not [r for r in caplog.records if r.name == "engine.core.stats_log"]
        finally:
            engine.shutdown()


def test_a_core_process_under_a_warning_root_logger_still_logs_its_lines(tmp_path, capfd):
    """A Ray replica's root logger is at WARNING and the core process inherits that level: the stats lines
    (asked for with log_stats_interval_s) must still reach the process's stderr, which Ray forwards."""
    from engine_harness import write_tiny_config

    root = logging.getLogger()
    stats_logger = logging.getLogger("engine.core.stats_log")
    levels = root.level, stats_logger.level
    root.setLevel(logging.WARNING)
    stats_logger.setLevel(logging.NOTSET)
    try:
        folder = write_tiny_config(tmp_path)
        engine = make_engine(
            model=folder, load_format="dummy", skip_tokenizer_init=True, core_process=True, log_stats_interval_s=1e-6
        )
        try:
            engine.generate([[1, 2, 3, 4]] * 3, dict(temperature=0.0, max_new_tokens=8, ignore_eos=True))
        finally:
            engine.shutdown()
    finally:
        root.setLevel(levels[0])
        stats_logger.setLevel(levels[1])
    err = capfd.readouterr().err
    assert "engine.core.stats_log: last " in err and "longest step" in err


def test_device_clock_on_the_cpu_records_nothing():
    import torch

    from engine.runner.device_clock import DeviceClock

    clock = DeviceClock(torch.device("cpu"))
    started = clock.start()
    assert started is None
    clock.stop(started, "decode")
    assert clock.busy_s() == 0.0 and clock.gap_s() == {"decode": 0.0, "prefill": 0.0, "mixed": 0.0}


def test_device_clock_bookkeeping_with_events_on_a_fake_device_timeline(monkeypatch):
    """Busy = Σ start → stop; a gap = previous stop → start, counted for steps launched back to back, by kind;
    steps are collected in stream order, only once finished."""
    import torch

    from engine.runner import device_clock
    from engine.runner.device_clock import DeviceClock

    timeline = {"now": 0.0, "finishes": True}

    class Event:  # a CUDA event on a fake device: it completes at the time set when it is recorded
        def __init__(self, enable_timing=False):
            self.at, self.done = None, False

        def record(self):
            self.at, self.done = timeline["now"], timeline["finishes"]

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(device_clock.torch.cuda, "Event", Event)
    clock = DeviceClock(torch.device("cpu"))
    clock.enabled = True

    def step(kind, begin, end):
        timeline["now"] = begin
        started = clock.start()
        timeline["now"] = end
        clock.stop(started, kind)

    step("prefill", 0.0, 1.0)
    step("decode", 1.0, 1.5)  # back to back: no gap
    step("mixed", 1.75, 2.75)  # 0.25 s gap before a mixed step
    clock.break_chain()
    step("decode", 10.0, 10.5)  # after the scheduler had nothing to do: no gap
    step("decode", 10.6, 11.0)  # 0.1 s gap before a decode step
    assert clock.busy_s() == pytest.approx(1.0 + 0.5 + 1.0 + 0.5 + 0.4)
    assert clock.gap_s() == pytest.approx({"prefill": 0.0, "decode": 0.1, "mixed": 0.25})
    timeline["now"] = 12.0
    started = clock.start()
    timeline["now"], timeline["finishes"] = 13.0, False
    clock.stop(started, "decode")  # still running on the device: not collected yet
    assert clock.busy_s() == pytest.approx(3.4)
    clock._pending[-1].stop.done = True
    assert clock.busy_s() == pytest.approx(4.4) and clock.gap_s()["decode"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="kind"):
        clock.stop(clock.start(), "extend")


@pytest.mark.gpu
def test_device_clock_sums_step_time_and_the_gaps_between_steps_launched_back_to_back():
    import time

    import torch

    from engine.runner.device_clock import DeviceClock

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = torch.randn(4096, 4096, device="cuda")
    clock = DeviceClock(torch.device("cuda"))

    def step(kind):
        nonlocal a
        started = clock.start()
        for _ in range(20):
            a = torch.tanh(a @ a)
        clock.stop(started, kind)
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    step("prefill")
    time.sleep(0.05)  # the host is late: the device waits 50 ms before the next step, a gap
    step("mixed")
    clock.break_chain()  # then the scheduler had nothing to launch: the wait before the next step is no gap
    time.sleep(0.2)
    step("decode")
    wall = time.perf_counter() - t0
    busy, gaps = clock.busy_s(), clock.gap_s()
    assert 0 < busy < wall
    assert gaps["mixed"] >= 0.05 and gaps["decode"] == 0 and gaps["prefill"] == 0
    assert not clock._pending  # every finished step collected
    clock.reset()
    assert clock.busy_s() == 0 and sum(clock.gap_s().values()) == 0
