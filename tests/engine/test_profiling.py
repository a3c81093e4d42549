"""engine/profiling.py: torch profiler traces of the scheduler's loop, on request."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from engine.profiling import ProfileError, label
from engine_harness import assert_no_leak, make_engine, write_tiny_config


def _names(path: str) -> set:
    with gzip.open(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_a_profile_records_the_loop_stages_and_stops_by_itself_after_num_steps(tmp_path):
    folder = write_tiny_config(tmp_path)
    out = tmp_path / "traces"
    engine = make_engine(model=folder, load_format="dummy", skip_tokenizer_init=True, profile_dir=str(out))
    try:
        params = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        path = engine.start_profile(num_steps=3)
        assert os.path.dirname(path) == str(out) and path.endswith(".trace.json.gz")
        with pytest.raises(ProfileError, match="already recording"):
            engine.start_profile()
        engine.generate([[1, 2, 3, 4, 5]] * 2, params)  # more than 3 steps: the profile stopped by itself
        assert os.path.exists(path)
        assert {"plan", "prepare", "launch", "resolve", "process"} <= _names(path)
        with pytest.raises(ProfileError, match="no profile is recording.*the last trace"):
            engine.stop_profile()
        second = engine.start_profile()  # until stopped
        engine.generate([[7, 8, 9]], params)
        assert engine.stop_profile() == second and "launch" in _names(second)
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_profiling_is_off_without_a_folder_and_num_steps_must_be_positive(tmp_path):
    folder = write_tiny_config(tmp_path)
    engine = make_engine(model=folder, load_format="dummy", skip_tokenizer_init=True)
    try:
        for call in (engine.start_profile, engine.stop_profile):
            with pytest.raises(ProfileError, match="profiling is off"):
                call()
    finally:
        engine.shutdown()
    engine = make_engine(model=folder, load_format="dummy", skip_tokenizer_init=True, profile_dir=str(tmp_path))
    try:
        with pytest.raises(ProfileError, match="num_steps"):
            engine.start_profile(num_steps=0)
    finally:
        engine.shutdown()


def test_labels_cost_nothing_while_no_profile_records():
    import contextlib

    assert isinstance(label("plan"), contextlib.nullcontext)
