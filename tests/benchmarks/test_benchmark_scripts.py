"""The benchmark scripts run end to end on tiny workloads (they measure nothing here: no timing
is asserted, only that they complete every request and write their JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine_harness import assert_no_leak, write_tiny_config
from serving_harness import MODEL, serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(name, *args):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", name), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize(
    "name",
    [
        "bench_offline.py",
        "bench_serving.py",
        "bench_overhead.py",
        "bench_overload.py",
        "bench_router.py",
        "bench_kv_transfer.py",
        "bench_decode.py",
        "bench_decode_attention.py",
        "bench_mixed_step.py",
        "bench_route_calls.py",
        "bench_cluster.py",
        "bench_overlap.py",
        "bench_gemv.py",
        "bench_frontend.py",
        "trace_gaps.py",
        "bench_online.py",
        "bench_tp.py",
        "bench_allreduce.py",
        "bench_grammar.py",
        "bench_encoder.py",
        "bench_gemm_power.py",
        "bench_prefill_attention.py",
        "gemv_occupancy.py",
        "ab_decode.py",
    ],
)
def test_help(name):
    proc = run_script(name, "--help")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dataset", ["shared-prefix", "multi-turn"])
def test_bench_serving_against_the_server(default_engine, tmp_path, dataset):
    from serving.app import build_app
    from serving.backend import EngineBackend

    out = tmp_path / "result.json"
    with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
        proc = run_script(
            "bench_serving.py",
            "--base-url",
            url,
            "--model",
            MODEL,
            "--dataset",
            dataset,
            "--num-groups",
            "2",
            "--prompts-per-group",
            "2",
            "--system-prompt-len",
            "64",
            "--num-conversations",
            "2",
            "--num-turns",
            "2",
            "--output-len",
            "4",
            "--max-concurrency",
            "2",
            "--out",
            str(out),
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    summary = result.get("summary") or result
    assert summary["completed"] == summary["requests"] > 0 and summary["failed"] == 0
    assert_no_leak(default_engine)


def test_bench_overload_sees_the_excess_refused(default_engine, tmp_path):
    """A burst beyond max_running_requests + max_queued_requests: the excess gets 503 + Retry-After."""
    from serving.app import build_app
    from serving.backend import EngineBackend

    config, out = default_engine.config, tmp_path / "overload.json"
    saved = config.max_running_requests, config.max_queued_requests
    object.__setattr__(config, "max_running_requests", 2)  # frozen dataclass; restored below
    object.__setattr__(config, "max_queued_requests", 1)
    try:
        with serve(build_app(EngineBackend(default_engine), model_name=MODEL)) as url:
            args = ["--url", url, "--model", MODEL, "--capacity", "3", "--burst", "8", "--max-tokens", "24"]
            proc = run_script("bench_overload.py", *args, "--out", str(out))
    finally:
        object.__setattr__(config, "max_running_requests", saved[0])
        object.__setattr__(config, "max_queued_requests", saved[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    phases = run["phases"]
    assert phases["capacity"]["admitted"] == 3 and phases["capacity"]["refused"] == 0
    burst = phases["burst"]
    assert burst["admitted"] + burst["refused"] == 8 and burst["refused"] >= 1
    assert burst["statuses"] == [200, 503] and burst["retry_after"] == ["1"]
    # each request also timed from its own send, which follows the burst start
    assert 0 <= burst["first_send_s"] <= burst["last_send_s"]
    assert burst["send_spread_s"] == burst["last_send_s"] - burst["first_send_s"]
    assert 0 < burst["slowest_refusal_from_send_s"] <= burst["slowest_refusal_s"]
    assert 0 < burst["admitted_p99_from_send_s"] <= burst["admitted_p99_s"]
    assert_no_leak(default_engine)


def test_bench_cluster_names_repeated_variants_apart():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_cluster

    unified, disagg = {"workers": 1}, {"mode": "disaggregated"}
    assert bench_cluster.run_names([unified, disagg, unified, disagg, unified]) == [
        "workers=1",
        "mode=disaggregated",
        "workers=1 #2",
        "mode=disaggregated #2",
        "workers=1 #3",
    ]


def test_bench_cluster_default_file_name_fits_the_file_system():
    """Four disaggregated variants made a default name of over 255 bytes (an OSError after the whole run): the
    name is now cut to MAX_FILE_NAME with a hash of the whole, so other variant lists still get other names."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_cluster

    assert bench_cluster.default_file_name(["policy=cache_aware", "policy=round_robin"], 3000) == (
        "cluster_policycache_aware-vs-policyround_robin_kv3000.json"
    )
    pd = "mode=disaggregated,prefill_workers=1,decode_workers=1"
    long = [pd, pd + ",core_process=True", pd + " #2", pd + ",core_process=True #2"]
    name = bench_cluster.default_file_name(long, 8192)
    assert len(name) <= bench_cluster.MAX_FILE_NAME and name.endswith("_kv8192.json") and " " not in name
    assert name.startswith("cluster_modedisaggregated_prefill_workers1_decode_workers1-vs-")
    assert bench_cluster.default_file_name(long[:3] + [pd + " #3"], 8192) != name


def _sse_client(events):
    """An httpx.AsyncClient whose every POST answers these SSE events (dicts, then [DONE])."""
    import httpx

    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.AsyncClient(
        base_url="http://test",
        transport=httpx.MockTransport(
            lambda request: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        ),
    )


def test_bench_serving_counts_every_chunk_with_choices_as_a_token_event():
    """vllm bench serve's rule: a chunk with non-empty choices is a token event even when its text is
    empty (role chunk, undecodable token); the usage-only chunk is none, and its usage is kept."""
    import asyncio

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_serving as bs

    args = bs.build_parser().parse_args(["--output-len", "4"])
    chat = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "a"}}]},
        {"choices": [{"index": 0, "delta": {"content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}},
        },
    ]
    completion = [
        {"choices": [{"index": 0, "text": ""}]},
        {"choices": [{"index": 0, "text": "x"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
    ]

    async def go(events, turn):
        async with _sse_client(events) as client:
            return await bs.send(client, args, turn, [])

    res = asyncio.run(go(chat, bs.Turn(messages=[{"role": "user", "content": "hi"}])))
    assert res.ok and len(res.pieces) == 4 and len(res.itl) == 3 and res.ttft > 0
    assert (res.text, res.prompt_tokens, res.output_tokens, res.cached_tokens) == ("ab", 7, 3, 2)
    res = asyncio.run(go(completion, bs.Turn(prompt="hi")))
    assert res.ok and len(res.pieces) == 2 and len(res.itl) == 1 and res.output_tokens == 2
    summary = bs.summarize([res], 1.0, None, None)
    assert summary["events_per_output_token"] == 1.0
    assert summary["tpot_ms"]["mean"] == (res.e2e - res.ttft) * 1e3


def test_bench_serving_gives_each_request_in_flight_a_connection_of_its_own():
    """Lanes: with C requests in flight the server sees at most C connections, each kept alive and reused by
    the requests that follow, and never more than C requests at once; every request completes."""
    import asyncio

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_serving as bs

    seen = {"ports": set(), "open": 0, "most": 0, "requests": 0}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen["ports"].add(scope["client"][1])
        seen["requests"] += 1
        seen["open"] += 1
        seen["most"] = max(seen["most"], seen["open"])
        try:
            while (await receive()).get("more_body"):
                pass
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for event in ({"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]}):
                await asyncio.sleep(0.01)
                await send(
                    {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            seen["open"] -= 1

    with serve(app) as url:
        argv = [
            "--base-url",
            url,
            "--dataset",
            "random",
            "--num-prompts",
            "24",
            "--input-len",
            "8",
            "--output-len",
            "2",
        ]
        argv += ["--max-concurrency", "4"]
        args = bs.build_parser().parse_args(argv)
        sessions = bs.make_workload(args)
        results, _ = asyncio.run(bs.run_load(args, sessions))
    n = sum(len(turns) for turns in sessions)
    assert n > 4 and len(results) == n and all(r.ok and r.text == "ab" for r in results)
    assert seen["requests"] == n and seen["most"] <= 4
    assert len(seen["ports"]) == 4  # one keep-alive connection per lane, made before the clock started


def test_bench_serving_lanes_reuse_the_last_freed_client_and_grow_on_demand():
    """A lane is one client with one connection; the last one given back is taken first (its connection is
    the freshest); more are made only when every lane is busy."""
    import asyncio

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_serving as bs

    async def go():
        lanes = bs.Lanes(base_url="http://test")
        lanes.prepare(2)
        a, b = lanes.take(), lanes.take()
        c = lanes.take()  # both busy: a third is made
        assert len(lanes) == 3 and len({id(a), id(b), id(c)}) == 3
        lanes.give(a)
        lanes.give(c)
        assert lanes.take() is c and lanes.take() is a and len(lanes) == 3
        assert c._transport._pool._max_connections == 1
        await lanes.aclose()

    asyncio.run(go())


def test_bench_serving_timeline_lists_requests_in_send_order():
    """bench_online keeps each request's send time, TTFT and E2E (bench_serving.timeline): in the order sent,
    times from the first send, a failed request with zero latencies."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_serving as bs

    late = bs.Result(ok=True, ttft=0.25, e2e=1.5, prompt_tokens=9, cached_tokens=4, start=102.0)
    first = bs.Result(ok=True, ttft=0.125, e2e=1.0, prompt_tokens=8, start=100.0)
    failed = bs.Result(ok=False, ttft=0.5, e2e=0.5, start=100.5)
    assert bs.timeline([late, first, failed]) == {
        "sent_s": [0.0, 0.5, 2.0],
        "ttft_ms": [125.0, 0.0, 250.0],
        "e2e_ms": [1000.0, 0.0, 1500.0],
        "prompt_tokens": [8, 0, 9],
        "cached_tokens": [0, 0, 4],
    }
    assert bs.timeline([]) == {"sent_s": [], "ttft_ms": [], "e2e_ms": [], "prompt_tokens": [], "cached_tokens": []}


def test_bench_serving_reads_vllm_prefix_cache_counters(monkeypatch):
    """A server without /router/stats and radixserve's counters: vLLM's prefix-cache counters (summed over
    its engines) give the server-side hit rate."""
    import httpx

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_serving as bs

    metrics = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 150.0\n'
    )

    def get(url, **_):
        if url.endswith("/metrics"):
            return httpx.Response(200, text=metrics)
        return httpx.Response(404, text="not found")

    monkeypatch.setattr(httpx, "get", get)
    got = bs.server_cache_counters("http://server", None)
    assert got == {"source": "vllm_metrics", "prompt_tokens": 1500.0, "cached_tokens": 750.0}
    monkeypatch.setattr(httpx, "get", lambda url, **_: httpx.Response(200 if url.endswith("/metrics") else 404))
    assert bs.server_cache_counters("http://server", None) is None


def test_bench_online_records_both_sides_http_loop_and_parser(monkeypatch):
    """Each side's uvicorn loop and parser, read in its own environment (here both are this one)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_online

    monkeypatch.setenv("VLLM_PYTHON", sys.executable)
    monkeypatch.setenv("VLLM_PYTHONPATH", "")
    stacks = bench_online.http_stacks()
    assert stacks["radixserve"] == stacks["vllm"] == {"loop": "uvloop", "parser": "httptools"}
    monkeypatch.setenv("VLLM_PYTHON", "/nonexistent/python")
    assert "error" in bench_online.http_stacks()["vllm"]


def test_bench_online_merge_keeps_the_http_stack_of_a_side_it_does_not_measure(monkeypatch):
    """A --merge run of our servers alone must not overwrite how vLLM's earlier run parsed HTTP."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_online

    fast, slow = {"loop": "uvloop", "parser": "httptools"}, {"loop": "uvloop", "parser": "h11"}
    earlier = {"radixserve": fast, "vllm": fast}
    now = {"radixserve": fast, "vllm": slow}
    assert bench_online.merged_http_stacks(earlier, now, ["cluster"]) == {"radixserve": fast, "vllm": fast}
    assert bench_online.merged_http_stacks(earlier, now, ["vllm", "serving"]) == now
    assert bench_online.merged_http_stacks({}, now, ["cluster"]) == now


def test_bench_online_merge_keeps_a_servers_workloads_it_does_not_measure_again(monkeypatch):
    """A --merge run of a server already in the JSON keeps that server's other workloads (every per-workload
    table) and lists the earlier starts; a workload measured again is this run's alone."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_online

    first = {
        "workloads": {"random-64": {"request_throughput": 19.0}, "multi-turn": {"request_throughput": 35.0}},
        "kv": {"random-64": {"kv_no_leak": True}, "multi-turn": {"kv_no_leak": True}},
        "stats_lines": {"multi-turn": ["last 10.0 s: ..."]},
        "measured_at": "2026-12-02T09:40:00",
        "started_s": 41.0,
        "stop": {"port_free": True},
    }
    kept = bench_online.kept_from_earlier_run(first, ["random-8", "multi-turn"])
    assert kept["workloads"] == {"random-64": {"request_throughput": 19.0}}
    assert kept["kv"] == {"random-64": {"kv_no_leak": True}}
    assert "stats_lines" not in kept and "repeats" not in kept
    assert kept["earlier_starts"] == [
        {
            "measured_at": "2026-12-02T09:40:00",
            "started_s": 41.0,
            "stop": {"port_free": True},
            "workloads": ["random-64", "multi-turn"],
        }
    ]
    second = {**first, **kept, "measured": ["random-8"], "measured_at": "2026-12-02T09:50:00"}
    second["workloads"] = {**kept["workloads"], "random-8": {"request_throughput": 5.5}}
    again = bench_online.kept_from_earlier_run(second, ["random-256"])
    assert set(again["workloads"]) == {"random-64", "random-8"}
    assert [(s["measured_at"], s["workloads"]) for s in again["earlier_starts"]] == [
        ("2026-12-02T09:40:00", ["random-64", "multi-turn"]),
        ("2026-12-02T09:50:00", ["random-8"]),
    ]


def test_host_probe_reads_steal_from_proc_stat_and_times_its_workload(tmp_path, monkeypatch):
    """host_probe: steal over a stretch from two /proc/stat first lines (all CPUs, clock ticks), None where
    the file lacks the column; the probe's time is positive and `between` keeps both ends and the steal."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import host_probe

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n")
    before = host_probe.cpu_times(str(stat))
    stat.write_text("cpu  160 0 70 900 10 0 0 60 0 0\n")
    after = host_probe.cpu_times(str(stat))
    assert before["steal"] == 40 and after["user"] == 160
    assert host_probe.steal_pct(before, after) == pytest.approx(100 * 20 / 200)
    assert host_probe.steal_pct(before, before) is None and host_probe.steal_pct(None, after) is None
    stat.write_text("cpu  100 0 50 800\n")  # a kernel without the steal column
    assert host_probe.cpu_times(str(stat)) is None
    assert host_probe.cpu_times(str(tmp_path / "missing")) is None
    assert host_probe.probe_us(loops=1000, trials=3) > 0
    start = host_probe.Snapshot(probe_us=812.34, cpu=before)
    got = host_probe.between(start, host_probe.Snapshot(probe_us=1490.06, cpu=after))
    assert got == {"probe_us_before": 812.3, "probe_us_after": 1490.1, "steal_pct": 10.0}


def test_bench_online_ratios_and_table_from_fabricated_summaries():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_online

    def summary(rps, ttft, itl, tpot):
        return {
            "completed": 8,
            "failed": 0,
            "request_throughput": rps,
            "output_throughput_tok_s": rps * 256,
            "ttft_ms": {"p50": ttft, "p90": 2 * ttft},
            "itl_ms": {"p50": itl, "p90": 2 * itl},
            "e2e_ms": {"p50": 1000.0},
            "tpot_ms": {"mean": tpot},
            "events_per_output_token": 1.0,
        }

    runs = {
        "serving": {
            "workloads": {"random-8": summary(3.0, 60.0, 14.0, 14.0), "random-64": summary(10.0, 500.0, 20.0, 21.0)}
        },
        "vllm": {"workloads": {"random-8": summary(4.0, 40.0, 7.0, 7.0)}},
        "cluster": {"workloads": {"random-8": dict(summary(1.0, 1.0, 1.0, 1.0), completed=0)}},
    }
    r = bench_online.ratios(runs)
    assert set(r) == {"serving"} and set(r["serving"]) == {"random-8"}  # no vLLM figure / nothing completed
    assert r["serving"]["random-8"]["request_throughput"] == 0.75
    assert r["serving"]["random-8"]["itl_ms.p50"] == 2.0 and r["serving"]["random-8"]["ttft_ms.p90"] == 1.5
    text = bench_online.table({"runs": runs, "ratios_to_vllm": r})
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [row[:2] for row in rows] == [
        ["random-8", "vllm"],
        ["random-8", "serving"],
        ["random-8", "cluster"],
        ["random-64", "serving"],
    ]
    assert rows[1][-4:] == ["0.75", "1.50", "2.00", "2.00"]
    assert bench_online.workload_argv("random-8", {"random-8": 16}, ["--output-len", "8"])[-4:] == [
        "--num-prompts",
        "16",
        "--output-len",
        "8",
    ]


def test_bench_online_repeats_draw_new_prompts_and_report_the_median_run():
    """--repeat: run k of a workload has its own seed (new prompts, none in the cache the runs before filled,
    and no other workload's); the table's run is the one of median req/s, a run with a failed request only
    when all had one; the JSON keeps each run's seed and figures."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_online

    def seed(argv):
        return argv[argv.index("--seed") + 1]

    seeds = {seed(bench_online.workload_argv(w, {}, [], k)) for w in bench_online.WORKLOADS for k in range(3)}
    assert len(seeds) == 3 * len(bench_online.WORKLOADS)
    assert seed(bench_online.workload_argv("random-64", {}, [], 0)) == str(bench_online.workload_seed("random-64"))

    def run(rate, failed=0):
        return {"request_throughput": rate, "failed": failed, "ttft_ms": {"p50": 1.0, "mean": 2.0}}

    assert bench_online.median_run([run(19.4), run(22.0), run(20.1)]) == 2
    assert bench_online.median_run([run(19.4), run(22.0)]) == 0  # even count: the slower middle one
    assert bench_online.median_run([run(30.0, failed=1), run(19.4), run(22.0)]) == 1
    assert bench_online.median_run([run(30.0, failed=1)]) == 0
    argv = bench_online.workload_argv("random-256", {}, ["--seed", "7"], 1)  # a --seed after `--` wins
    figures = bench_online.repeat_figures(run(21.97), argv)
    assert figures["seed"] == 7 and figures["request_throughput"] == 21.97 and figures["ttft_ms.mean"] == 2.0
    speed = {"probe_us_before": 800.0, "probe_us_after": 1400.0, "steal_pct": 0.5}
    assert bench_online.repeat_figures(dict(run(21.97), host_speed=speed), argv)["host_speed"] == speed


def test_bench_online_engine_tpot_is_measured_at_the_random_1_shape_and_compared():
    """--engine-tpot: bench_decode's engine TPOT at random-1's input / output lengths, and each radixserve
    server's random-1 TPOT over it (vLLM's is not ours to compare with the engine)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_online

    argv = bench_online.engine_tpot_argv("/models/llama", "/tmp/x.json")
    assert argv[1].endswith("bench_decode.py") and "--engine-tpot" in argv
    assert argv[argv.index("--config") + 1] == "/models/llama/config.json"
    shape = bench_online.WORKLOADS["random-1"]
    for flag, ours in (("--input-len", "--tpot-input-len"), ("--output-len", "--tpot-output-len")):
        assert argv[argv.index(ours) + 1] == shape[shape.index(flag) + 1]
    tpot = {"tpot_ms": {"mean": 4.2}}
    record = {
        "engine_tpot": {"tpot_ms": 4.0},
        "runs": {
            "vllm": {"workloads": {"random-1": tpot}},
            "serving": {"workloads": {"random-1": tpot}},
            "cluster": {"workloads": {"random-8": tpot}},
        },
    }
    assert bench_online.endpoint_over_engine(record) == {"serving": pytest.approx(1.05)}
    assert bench_online.endpoint_over_engine({"engine_tpot": {"error": "x"}, "runs": record["runs"]}) == {}


def test_bench_encoder_times_both_ways_and_checks_the_ids(tmp_path):
    out = tmp_path / "encoder.json"
    proc = run_script("bench_encoder.py", "--bursts", "1", "3", "--threads", "1", "--repeats", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert [(r["variant"], r["burst"]) for r in record["results"]] == [
        ("inline", 1),
        ("inline", 3),
        ("encoder, 1 thread", 1),
        ("encoder, 1 thread", 3),
    ]
    assert record["mean_prompt_tokens"] > 500 and "cpu_count" in record["hardware"]


def test_multi_turn_history_from_the_dataset_is_the_same_for_every_server():
    """--history dataset: each turn's answer in the history is fixed text (output-len words) drawn from the seed,
    so two servers whose answers differ are sent the same conversations; --history generated leaves it to
    the server's answer (None)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import argparse

    import bench_serving

    def workload(history):
        args = argparse.Namespace(
            dataset="multi-turn",
            seed=3,
            num_conversations=3,
            num_turns=2,
            question_len=5,
            output_len=7,
            history=history,
        )
        return bench_serving.make_workload(args)

    fixed = workload("dataset")
    assert fixed == workload("dataset")
    assert all(len(t.answer.split()) == 7 for s in fixed for t in s)
    assert all(t.answer is None for s in workload("generated") for t in s)


def test_gemv_occupancy_counts_the_programs_an_sm_holds():
    """Hopper's per-SM limits: registers in 256-register units per warp, 1 KiB of shared memory reserved per
    program, 64 warps, 32 programs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gemv_occupancy import programs_per_sm

    assert programs_per_sm(134, 4, 24576) == 3  # 136 x 32 registers per warp: 15 warps fit, 3 programs of 4
    assert programs_per_sm(227, 4, 40960) == 2
    assert programs_per_sm(56, 8, 1024) == 4  # 2,048 registers per warp: 32 warps
    assert programs_per_sm(32, 1, 0) == 32  # the program limit
    assert programs_per_sm(32, 4, 120_000) == 1  # shared memory
    assert programs_per_sm(255, 32, 0) == 0  # 32 warps of 255 registers do not fit


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="Triton's ptxas: x86-64 Linux")
def test_gemv_occupancy_compiles_the_engines_tiles_without_a_gpu(tmp_path):
    """Every weight of one Llama layer and the lm_head, the rows kernel at 8 rows with one and two tiles
    ahead, compiled for sm_90 by Triton's ptxas: resources read back, JSON written."""
    out = tmp_path / "occ.json"
    proc = run_script("gemv_occupancy.py", "--rows", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["weight"], r["config"]["prefetch"]) for r in rows] == [
        (w, a) for w in ("qkv", "o", "gate_up", "down", "lm_head") for a in (1, 2)
    ]
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["programs_per_sm"] >= 1 and r["programs"] >= 1
        assert r["gated"] == (r["weight"] == "gate_up")  # the engine runs gate_up with its SiLU epilogue
    qkv = {r["config"]["prefetch"]: r for r in rows if r["weight"] == "qkv"}
    assert qkv[2]["weight_bytes_in_flight_per_sm"] > qkv[1]["weight_bytes_in_flight_per_sm"]


FAKE_BENCH_DECODE = """
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--batch-sizes", type=int, nargs="+")
p.add_argument("--scale", type=float, default=1.0)
p.add_argument("--out")
a = p.parse_args()
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
value = float(open(os.path.join(here, "STEP_MS")).read()) * a.scale
with open(os.environ["AB_ORDER"], "a") as f:
    f.write(f"{here} {value}\\n")
rows = [dict(batch_size=b, step_ms=value, gpu_ms=value * b, roofline_ms=1.0) for b in a.batch_sizes]
json.dump(dict(results=rows), open(a.out, "w"))
"""


def test_ab_decode_interleaves_arms_on_patched_copies_and_compares_to_the_first(tmp_path):
    """Each round runs every arm once, in order; a patched arm runs its own copy of the tree (the patch applied
    there, not in the source); flags reach only their arm; the table's ratios are over the first arm's mean.
    The source tree's bench_decode.py is a stand-in that reads its tree's STEP_MS (no GPU here)."""
    src = tmp_path / "src"
    (src / "benchmarks").mkdir(parents=True)
    (src / "benchmarks" / "bench_decode.py").write_text(FAKE_BENCH_DECODE)
    (src / "STEP_MS").write_text("4.0\n")
    patch = tmp_path / "faster.patch"
    patch.write_text("--- a/STEP_MS\n+++ b/STEP_MS\n@@ -1 +1 @@\n-4.0\n+3.0\n")
    order, out = tmp_path / "order.txt", tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab_decode.py"), "--source", str(src)]
        + ["--arm", "base", "--arm", f"faster={patch}", "--arm", "slower=:--scale 2", "--rounds", "2"]
        + ["--trees-dir", str(tmp_path / "trees"), "--out", str(out), "--", "--batch-sizes", "1", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, AB_ORDER=str(order)),
    )
    assert proc.returncode == 0, proc.stderr
    assert (src / "STEP_MS").read_text() == "4.0\n"  # the source is left as it was
    ran = [line.split() for line in order.read_text().splitlines()]
    trees = [str(src), str(tmp_path / "trees" / "faster"), str(src)]
    assert ran == [[t, v] for t, v in zip(trees, ["4.0", "3.0", "8.0"])] * 2
    record = json.loads(out.read_text())
    assert [(r["arm"], r["round"]) for r in record["runs"]] == [
        (a, r) for r in (1, 2) for a in ("base", "faster", "slower")
    ]
    assert record["arms"][1]["patch"] == "faster.patch" and record["arms"][2]["flags"] == ["--scale", "2"]
    table = "\n".join(record["table"])
    assert "batch   8  base: 32.000 / 32.000 (1.000)  faster: 24.000 / 24.000 (0.750)" in table
    assert "slower: 64.000 / 64.000 (2.000)" in table


FAKE_BENCH_MIXED = """
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--decodes", type=int, nargs="+")
p.add_argument("--prefill", type=int, nargs="+")
p.add_argument("--out")
a = p.parse_args()
threads = float(os.environ.get("OMP_NUM_THREADS", "16"))
rows = [
    dict(decodes=d, prefill=n, gpu_ms=1.0 + d + n / 64, host_ms=threads, wall_ms=2.0, cuda_graph="piecewise",
         host_speed=dict(probe_us_before=1000.0, probe_us_after=1100.0, steal_pct=0.5))
    for d in a.decodes for n in a.prefill
]
json.dump(dict(rows=rows), open(a.out, "w"))
"""


def test_ab_decode_runs_mixed_steps_with_an_arm_environment(tmp_path):
    """--bench mixed runs bench_mixed_step.py, keys rows by (decodes, prefill) and compares device and host
    time, keeping each row's host speed; an arm's leading VAR=VALUE words reach only that arm's runs, as its
    environment."""
    src = tmp_path / "src"
    (src / "benchmarks").mkdir(parents=True)
    (src / "benchmarks" / "bench_mixed_step.py").write_text(FAKE_BENCH_MIXED)
    out = tmp_path / "ab.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab_decode.py"), "--source", str(src), "--bench", "mixed"]
        + ["--arm", "base", "--arm", "one=:OMP_NUM_THREADS=1", "--out", str(out)]
        + ["--", "--decodes", "8", "--prefill", "64", "128"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["bench"] == "bench_mixed_step.py"
    assert record["arms"][1]["env"] == {"OMP_NUM_THREADS": "1"} and record["arms"][1]["flags"] == []
    assert all(row["host_speed"]["steal_pct"] == 0.5 for run in record["runs"] for row in run["results"])
    table = "\n".join(record["table"])
    assert "8 + 64  base: 10.000 / 10.000 (1.000)  one: 10.000 / 10.000 (1.000)" in table
    assert "host time to enqueue a step (ms)" in table
    assert "8 + 128  base: 16.000 / 16.000 (1.000)  one: 1.000 / 1.000 (0.062)" in table


def test_ab_decode_refuses_bad_arms(tmp_path):
    for spec, message in (("=x", "empty name"), ("a=missing.patch", "no patch file")):
        proc = run_script("ab_decode.py", "--arm", spec, "--out", str(tmp_path / "x.json"))
        assert proc.returncode != 0 and message in proc.stderr
    proc = run_script("ab_decode.py", "--arm", "a", "--arm", "a", "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0 and "must differ" in proc.stderr


def test_bench_gemv_shapes_are_one_ranks_share():
    """--tensor-parallel-size N times the weights rank 0 of N holds: halved heads, MLP and vocabulary at 2."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_gemv import decode_shapes

    with open(os.path.join(ROOT, "benchmarks", "configs", "llama-3.1-8b.json")) as f:
        cfg = json.load(f)
    assert decode_shapes(cfg) == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }
    assert decode_shapes(cfg, 2) == {
        "qkv": (3072, 4096),
        "o": (4096, 2048),
        "gate_up": (14336, 4096),
        "down": (4096, 7168),
        "lm_head": (64128, 4096),
    }


def test_bench_mixed_step_batches_are_the_schedulers_mixed_steps(tmp_path):
    """A mixed step puts its decode tokens first and cuts prompt tokens into prompts of --prompt-len, and
    its decode rows give the tokens the decode step alone gives (what it times is a real mixed step)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_mixed_step import MixedStepBench

    from engine.forward_batch import ForwardMode

    model = write_tiny_config(tmp_path)
    bench = MixedStepBench(model, 3, context_len=16, max_prefill=40, prompt_len=32, dtype="float32")
    mixed, decode = bench.batch(3, 40), bench.batch(3, 0)
    assert mixed.forward_mode is ForwardMode.EXTEND and decode.forward_mode is ForwardMode.DECODE
    assert mixed.extend_seq_lens_cpu == [1, 1, 1, 32, 8]
    assert mixed.extend_prefix_lens_cpu == [16, 16, 16, 0, 0]
    with torch.inference_mode():
        alone = bench.launch(decode).tolist()
        together = bench.launch(mixed).tolist()
    assert len(together) == 5 and together[:3] == alone


def test_trace_gaps_attributes_idle_device_time_to_the_loop_stages(tmp_path):
    """A fabricated trace: kernels 0-100, 100-200 (back to back), 260-300, 1000-1010 (µs), host stages over the
    gaps: the 60 µs gap half under `process`, half under `plan`; the 700 µs gap under `prepare` for 500 µs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gzip

    import trace_gaps

    def x(cat, name, ts, dur, correlation=None, tid=1):
        args = {} if correlation is None else {"correlation": correlation}
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=1, tid=tid, args=args)

    events = [
        x("kernel", "gemm", 0, 100),
        x("kernel", "gemm", 100, 100),
        x("gpu_memcpy", "copy", 260, 40, correlation=7),
        x("kernel", "attn", 1000, 10, correlation=8),
        x("user_annotation", "process", 170, 60),
        x("user_annotation", "plan", 230, 70),
        x("user_annotation", "prepare", 400, 500),
        x("cpu_op", "aten::mm", 150, 900),  # not a stage: no share in the stage split
        x("cpu_op", "aten::copy_", 240, 20),  # inside aten::mm: the innermost op there
        x("cuda_runtime", "cudaMemcpyAsync", 210, 5, correlation=7),  # launched 10 µs into the 60 µs gap
        x("cuda_runtime", "cudaLaunchKernel", 980, 5, correlation=8),  # 680 µs into the 700 µs gap
        x("cpu_op", "aten::add", 200, 900, tid=2),  # another thread: not the loop's
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    r = trace_gaps.analyze(trace_gaps.load_events(str(path)), min_gap_us=50)
    assert r["window_ms"] == 1.01 and r["device_busy_ms"] == 0.25 and r["idle_ms"] == 0.76
    assert r["large_gaps"] == 2 and r["small_gaps"] == 0
    by_stage = r["large_gap_idle_by_stage_ms"]
    assert by_stage["process"] == 0.03 and by_stage["plan"] == 0.03 and by_stage["prepare"] == 0.5
    assert by_stage[trace_gaps.OUTSIDE] == 0.2
    assert [g["idle_us"] for g in r["largest_gaps"]] == [700.0, 60.0]
    assert [g["next"] for g in r["largest_gaps"]] == ["attn", "copy"]
    assert [g["before_launch_us"] for g in r["largest_gaps"]] == [680.0, 10.0]
    assert r["large_gap_idle_before_launch_ms"] == 0.69
    # sampled every 10 µs over 200-260 and 300-1000, all inside aten::mm but for the innermost calls at
    # 210 (cudaMemcpyAsync), 240 and 250 (aten::copy_) and 980 (cudaLaunchKernel)
    ops = {"aten::mm": 0.72, "aten::copy_": 0.02, "cudaMemcpyAsync": 0.01, "cudaLaunchKernel": 0.01}
    assert r["large_gap_host_ops_ms"] == ops
    out = tmp_path / "gaps.json"
    done = run_script("trace_gaps.py", str(path), "--min-gap-us", "50", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["large_gaps"] == 2 and "prepare" in done.stdout
    with pytest.raises(ValueError, match="no device events"):
        trace_gaps.analyze([x("user_annotation", "plan", 0, 10)])


def test_bench_online_keeps_the_stats_lines_each_workload_logged(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_online

    server = bench_online.ServingServer(bench_online.build_parser().parse_args([]), str(tmp_path))
    log = tmp_path / "server_serving.log"
    assert server.new_stats_lines() == []  # no log yet
    line = "2026-11-29 12:26:19,292 INFO engine-core[1495] engine.core.stats_log: last 10.0 s: prompt 925 tok/s"
    log.write_text(f"INFO: started\n{line}\n")
    assert server.new_stats_lines() == ["last 10.0 s: prompt 925 tok/s"]
    with open(log, "a") as f:
        f.write("INFO: POST /v1/completions\n" + line.replace("925", "4915") + "\n")
    assert server.new_stats_lines() == ["last 10.0 s: prompt 4915 tok/s"]  # only what came since
    assert server.new_stats_lines() == []


def test_bench_online_reads_the_serving_kv_gauges_as_the_server_exports_them(tmp_path, monkeypatch):
    """`python -m serving`'s leak check reads free / evictable / total tokens from the text that
    serving.metrics renders: free + evictable == total is no leak, anything less is one."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_online
    import httpx

    from serving.backend import ServingLoad
    from serving.metrics import Metrics

    server = bench_online.ServingServer(bench_online.build_parser().parse_args([]), str(tmp_path))
    for free, no_leak in ((700, True), (699, False)):
        metrics = Metrics("m")
        metrics.update_engine_gauges(ServingLoad(0, 0, 0.0, 0.5, 1000, free, 300))
        text = metrics.render().decode()
        monkeypatch.setattr(httpx, "get", lambda url, timeout, text=text: SimpleNamespace(text=text))
        kv = server.kv()
        assert (kv["kv_total_tokens"], kv["kv_free_tokens"], kv["kv_evictable_tokens"]) == (1000, free, 300)
        assert kv["kv_no_leak"] is no_leak and kv["running"] == 0.0


def test_bench_gemm_power_reads_one_layers_shapes_and_the_nvidia_smi_log(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_gemm_power

    with open(os.path.join(ROOT, "benchmarks", "configs", "llama-3.1-8b.json")) as f:
        shapes = bench_gemm_power.layer_shapes(json.load(f))
    # Llama-3.1-8B: 32 query heads and 8 KV heads of 128, hidden 4096, intermediate 14336
    assert shapes == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    log = tmp_path / "smi.csv"
    log.write_text(
        "2026/11/30 07:21:00.123, 1515 MHz, 690.18 W, 700.00 W\n"
        "[N/A], [N/A], [N/A], [N/A]\n"
        "2026/11/30 07:21:00.223, 1980 MHz, 130.44 W, 700.00 W\n"
    )
    rows = bench_gemm_power.sample_file(str(log))
    assert [(c, w) for _, c, w in rows] == [(1515.0, 690.18), (1980.0, 130.44)]
    assert abs(rows[1][0] - rows[0][0] - 0.1) < 1e-6


def test_bench_prefill_attention_reads_steps_and_counts_causal_pairs():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_prefill_attention as bpa

    step = bpa.parse_step("3,2@4")
    assert step == [(3, 0), (2, 4)]
    # 3 new tokens alone see 1 + 2 + 3 keys; 2 new tokens after 4 cached see 5 + 6
    assert bpa.causal_pairs(step) == 6 + 11
    for bad in ("0", "2@-1", "x"):
        with pytest.raises(ValueError):
            bpa.parse_step(bad)


def test_bench_decode_cublas_products_keep_only_one_row_on_the_gemv_kernels(tmp_path, monkeypatch):
    """--cublas-products qkv_proj lm_head: the runner built afterwards takes the GEMV kernels for those products
    at one row only (every layer's qkv, and the logits); the other products keep the engine's rows."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_decode

    import engine.runner.model_runner as runner_module
    from engine.config import EngineConfig
    from engine.models.source import resolve_model

    monkeypatch.setattr(runner_module, "set_gemv", runner_module.set_gemv)  # restored after the test
    with pytest.raises(ValueError, match="unknown"):
        bench_decode.override_gemv_products(["qkv"])
    changed = bench_decode.override_gemv_products(["qkv_proj", "lm_head"])
    folder = write_tiny_config(tmp_path)
    config = EngineConfig(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu")
    model = runner_module.ModelRunner(config, resolve_model(folder)).model
    layers = model.model.layers
    # the logits: the model's own gemv_rows, and the lm_head Linear where the embeddings are not tied
    assert changed == {"qkv_proj": len(layers), "lm_head": 1 + (not model.tie_word_embeddings)}
    assert model.gemv_rows == 1 and all(layer.self_attn.qkv_proj.gemv_rows == 1 for layer in layers)
    assert all(layer.self_attn.o_proj.gemv_rows == config.gemv_max_rows for layer in layers)
    assert all(layer.mlp.gate_up_proj.gemv_rows == config.gemv_max_rows for layer in layers)
