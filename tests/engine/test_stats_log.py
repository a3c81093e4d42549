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
    )
    line = log.line(second)  # rates, hit rate and device share of this interval only
    assert "last 10.0 s: prompt 100 tok/s (cache hit 90.0%), generation 50 tok/s" in line
    assert "steps 25 (prefill 5, 5 of them mixed; decode 20); longest step 10.0 ms; waiting on the device 10%" in line
    assert line.endswith("; device busy 95%")  # a GPU's share busy; no such part when it did not move (the CPU)


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


def test_device_clock_on_the_cpu_records_nothing():
    import torch

    from engine.runner.device_clock import DeviceClock

    clock = DeviceClock(torch.device("cpu"))
    started = clock.start()
    assert started is None
    clock.stop(started)
    assert clock.busy_s() == 0.0


@pytest.mark.gpu
def test_device_clock_sums_the_device_time_of_its_steps():
    import time

    import torch

    from engine.runner.device_clock import DeviceClock

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = torch.randn(4096, 4096, device="cuda")
    clock = DeviceClock(torch.device("cuda"))
    t0 = time.perf_counter()
    for _ in range(3):
        started = clock.start()
        for _ in range(20):
            a = a @ a / 64
        clock.stop(started)
        torch.cuda.synchronize()
        time.sleep(0.05)  # the device idles between steps: not counted
    wall = time.perf_counter() - t0
    busy = clock.busy_s()
    assert 0 < busy < wall - 3 * 0.05
    assert not clock._pending  # every finished step collected
