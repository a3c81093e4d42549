"""The unified cluster on a real local Ray cluster (CPU): Ingress + Router + 2 Workers.

One application for the whole module; the membership test kills a worker and the drain test stops the
ingress from admitting, so they run last. Serve's
Python proxy is in front (the other cluster tests use HAProxy): it passes a client's disconnect on at
once, where HAProxy passes it on at the ingress's next write, so the disconnect tests reach every
stage of a request. Nothing here asserts on timings.
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.config import ClusterArgs  # noqa: E402
from cluster_harness import (  # noqa: E402
    abort_storm,
    cluster_idle,
    router_stats,
    start_serve,
    stop_serve,
    streams_across_a_kill,
    wait_for,
)

pytestmark = pytest.mark.slow

APP = "radixserve-test"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster():
    args = ClusterArgs(workers=2, policy="round_robin", num_cpus=0.5, max_total_tokens=4096, report_interval_s=0.25)
    yield start_serve(args, APP, env={"RAY_SERVE_ENABLE_HA_PROXY": "0"})
    stop_serve()


_wait = wait_for


def _served(rids_by_worker_calls) -> dict:
    out = {}
    for d in rids_by_worker_calls:
        for wid, rids in d.items():
            for rid in rids:
                out[rid] = wid
    return out


def _worker_logs() -> dict:
    """rid → worker that served it, from every live worker. A just-killed replica may still be in
    this driver handle's replica set (membership updates are asynchronous): its answer is an
    ActorDiedError, which is skipped."""
    handle = serve.get_deployment_handle("Worker", APP)
    answers = handle.broadcast("served").results(timeout_s=30, return_exceptions=True)
    return _served(a for a in answers if not isinstance(a, BaseException))


def _decisions() -> dict:
    return serve.get_deployment_handle("Router", APP).decisions.remote().result(timeout_s=30)


def test_openai_completion_chat_and_stream(cluster):
    import openai

    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    pieces = []
    for chunk in client.chat.completions.create(
        model=MODEL, stream=True, max_tokens=16, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces).startswith(chat.choices[0].message.content)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_responses_and_anthropic_messages(cluster):
    """/v1/responses (plain, streamed, a function tool and its result, previous_response_id, the store in the
    router deployment: GET, input_items, DELETE) and Anthropic's /v1/messages (plain, streamed, tool use)
    through the cluster's ingress."""
    import anthropic
    import openai

    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)
    ask = "My name is Alice. Say hello to me."
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=8, temperature=0
    )
    first = client.responses.create(model=MODEL, input=ask, max_output_tokens=8, temperature=0)
    assert first.output_text == chat.choices[0].message.content
    events = list(
        client.responses.create(model=MODEL, input=ask, max_output_tokens=8, temperature=0, stream=True, store=False)
    )
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == first.output_text
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="What is my name?", max_output_tokens=8, temperature=0
    )
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text  # kept by the router deployment
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[1].id == first.output[0].id and items[2].content[0].text == "What is my name?"
    client.responses.delete(first.id)
    for lookup in (client.responses.retrieve, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            lookup(first.id)
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    asked = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[weather], tool_choice="required", max_output_tokens=32
    )
    call = asked.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=asked.id, input=[result], tools=[weather], max_output_tokens=4, temperature=0
    )
    assert answer.output and answer.previous_response_id == asked.id
    listed = client.responses.input_items.list(answer.id).data  # newest first
    assert listed[0].type == "function_call_output" and listed[-1].type == "message"
    assert call.id in [i.id for i in listed if i.type == "function_call"]

    claude = anthropic.Anthropic(base_url=cluster, api_key="unused", max_retries=0, timeout=120)
    greedy = {"model": MODEL, "max_tokens": 8, "extra_body": {"temperature": 0}}
    message = claude.messages.create(**greedy, messages=[{"role": "user", "content": ask}])
    assert message.content[0].text == chat.choices[0].message.content
    with claude.messages.stream(**greedy, messages=[{"role": "user", "content": ask}]) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    tool = {"name": "get_weather", "input_schema": weather["parameters"]}
    use = claude.messages.create(
        model=MODEL,
        max_tokens=32,
        tools=[tool],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert use.stop_reason == "tool_use" and use.content[0].name == "get_weather" and "city" in use.content[0].input


def test_greedy_output_equals_engine(http, default_engine):
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Q: What is 12 times 7?\nA:"]
    for prompt in prompts:
        ids = default_engine.tokenizer.encode(prompt)
        want = default_engine.generate(ids, {"temperature": 0, "max_new_tokens": 16})
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want.token_ids
        assert r.json()["text"] == want.text


def test_stop_strings_at_the_ingress_equal_engine(http, default_engine):
    """Workers stream token ids; the ingress makes the text and stops: text, finish reason, matched stop and
    completion_tokens equal one engine's (which stops itself), and a stopped choice is aborted on its worker
    while another choice of the request goes on."""
    ids = default_engine.tokenizer.encode("Write a short story about a lighthouse keeper.")
    sampled = {"temperature": 0.9, "seed": 11, "max_new_tokens": 40}
    first, second = default_engine.generate(ids, dict(sampled, n=2))
    stop = first.text[len(first.text) // 2 :][:3]  # occurs in choice 0's text, mid-way
    assert stop.strip() and stop in first.text
    for n in (1, 2):
        want = default_engine.generate(ids, dict(sampled, n=n, stop=[stop]))
        want = want if n > 1 else [want]
        r = http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": ids,
                "n": n,
                "temperature": 0.9,
                "seed": 11,
                "max_tokens": 40,
                "stop": [stop],
            },
        )
        assert r.status_code == 200, r.text
        got = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == [w.text for w in want]
        assert [c["finish_reason"] for c in got] == [w.finish_reason for w in want]
        assert want[0].finish_reason == "stop" and want[0].matched_stop == stop
        assert r.json()["usage"]["completion_tokens"] == sum(w.completion_tokens for w in want)
    _wait(
        lambda: all(
            w["engine"].get("running", 1) == 0 and w["engine"].get("waiting", 1) == 0 and w["in_flight"] == 0
            for w in router_stats(http)["workers"].values()
        ),
        20,
        "stopped choices aborted on the workers and finished at the router",
    )


def test_every_request_runs_on_the_routed_worker(cluster):
    """Pinning proof: for many concurrent requests (and one batched request, whose prompts are
    routed concurrently from one HTTP request), the worker that served each rid is the one the
    router chose for it."""

    async def run() -> list:
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as client:
            single = [
                client.post(
                    "/generate",
                    json={
                        "rid": f"pin-{i}",
                        "text": f"Request number {i} says",
                        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                    },
                )
                for i in range(24)
            ]
            batch = client.post(
                "/generate",
                json={
                    "rid": "pinbatch",
                    "text": [f"Batch prompt {i}:" for i in range(6)],
                    "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                },
            )
            return await asyncio.gather(*single, batch)

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    rids = [f"pin-{i}" for i in range(24)] + [f"pinbatch-{i}" for i in range(6)]
    decided, served = _decisions(), _worker_logs()
    assert {rid: served.get(rid) for rid in rids} == {rid: decided.get(rid) for rid in rids}
    assert len({decided[rid] for rid in rids}) == 2  # round_robin used both workers


def test_router_stats_and_cluster_metrics(http):
    s = router_stats(http)
    assert s["policy"] == "round_robin" and len(s["workers"]) == 2
    assert s["routed_requests"] > 0 and s["route_latency_ms"]["count"] > 0
    for wid, w in s["workers"].items():
        assert w["routed_requests"] > 0 and w["tree_tokens"] > 0
        assert w["engine"]["prompt_tokens"] > 0  # reports arrive
        assert w["engine"]["first_output_requests"] > 0 and w["engine"]["first_output_s"] > 0  # Worker's own counters
    replica = s["ingress_replica"]  # the answering ingress's own share of TTFT (percentiles and sums)
    assert replica["route_rpc_calls"] > 0 and replica["route_rpc_ms"]["count"] > 0
    # the router's totals over every ingress replica: each finished request's routing call and first message
    ingress = s["ingress"]
    assert ingress["route_rpc_calls"] > 0 and ingress["route_rpc_s"] > 0
    assert 0 < ingress["first_message_requests"] <= ingress["route_rpc_calls"] and ingress["first_message_s"] > 0
    _wait(lambda: all(w["events_applied"] > 0 for w in router_stats(http)["workers"].values()), 10, "cache events")
    text = http.get("/metrics").text
    for wid in s["workers"]:
        assert f'radixserve_worker_kv_cache_usage_ratio{{model_name="{MODEL}",pool="unified",replica="{wid}"}}' in text
        assert f'radixserve_worker_prefix_cache_hit_rate{{model_name="{MODEL}",pool="unified",replica="{wid}"}}' in text
    assert "radixserve_time_to_first_token_seconds_bucket" in text
    assert "radixserve_router_decision_latency_ms" in text


def test_client_disconnect_aborts_on_the_worker(cluster, http):
    body = {
        "model": MODEL,
        "prompt": "Count forever:",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=cluster, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break

    seen = []

    def aborted_and_idle():
        # Worker stats reach the router with its next poll: wait for a report taken after the abort.
        ws = router_stats(http)["workers"].values()
        seen[:] = [(w["in_flight"], w["engine"].get("running"), w["engine"].get("aborted")) for w in ws]
        idle = all(w["in_flight"] == 0 and w["engine"].get("running", 1) == 0 for w in ws)
        return idle and sum(w["engine"].get("aborted", 0) for w in ws) >= 1

    try:
        _wait(aborted_and_idle, 30, "the aborted request to be counted and to leave the worker and the router")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last (in_flight, running, aborted) per worker: {seen}") from None


def test_abort_storm_leaves_nothing_behind(cluster, http):
    """Half of 96 requests closed by their client at random stages: afterwards no request is in flight at
    the router, none runs or waits on a worker, and every KV page is free (or cached)."""
    counts = asyncio.run(abort_storm(cluster, MODEL, total=96))
    assert counts.get("aborted", 0) >= 16 and counts.get("completed", 0) >= 16 and not counts.get("error"), counts
    seen = {}

    def idle():
        seen["stats"] = {
            wid: (w["in_flight"], w["engine"].get("running"), w["engine"].get("waiting"))
            for wid, w in router_stats(http)["workers"].items()
        }
        return cluster_idle(router_stats(http))

    try:
        _wait(idle, 60, "every worker idle with its pages free")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; (in_flight, running, waiting) per worker: {seen.get('stats')}; {counts}"
        ) from None


def _story(i: int) -> dict:
    prompt = f"Story {i}: once upon a time, in a small village by the sea,"
    return dict(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, ignore_eos=True)


def test_dead_worker_is_purged_and_replaced(http):
    """Kill one worker's actor while 16 greedy streams run on both: every stream goes on on the survivor
    (continued from its tokens so far) and ends with [DONE] and the text of an undisturbed run; the
    router purges the dead worker, requests keep succeeding, and Serve's replacement joins."""
    before = set(router_stats(http)["workers"])
    victim, survivor = sorted(before)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Worker#{victim}", namespace="serve")
    bodies = [_story(i) for i in range(16)]
    reference, results = asyncio.run(
        streams_across_a_kill(str(http.base_url), bodies, lambda: ray.kill(actor, no_restart=True))
    )
    assert [text for text, _ in results] == reference
    print("largest gap between events per stream (s):", sorted(round(gap, 2) for _, gap in results))

    def gen(i: int):
        return http.post(
            "/generate",
            json={
                "rid": f"after-kill-{i}",
                "text": f"Hello {i}",
                "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            },
        )

    early = [gen(i) for i in range(4)]  # right after the kill: must not fail
    assert [r.status_code for r in early] == [200] * 4, [r.text for r in early]
    _wait(lambda: victim not in router_stats(http)["workers"], 60, "the router to purge the dead worker")
    assert victim in router_stats(http)["purged_workers"]
    served = _worker_logs()
    assert all(served.get(f"after-kill-{i}") == survivor for i in range(4))

    joined = _wait(lambda: set(router_stats(http)["workers"]) - before, 240, "a replacement worker to join", 1.0)
    (newcomer,) = joined
    rs = [gen(10 + i) for i in range(4)]
    assert all(r.status_code == 200 for r in rs)
    decided, served = _decisions(), _worker_logs()
    assert {served[f"after-kill-{10 + i}"] for i in range(4)} == {survivor, newcomer}
    assert all(served[f"after-kill-{10 + i}"] == decided[f"after-kill-{10 + i}"] for i in range(4))


def test_dead_engine_is_a_dead_worker(http):
    """Kill the scheduler's core process of one worker (its engine dies; a tensor-parallel rank's death ends
    an engine the same way) while 16 greedy streams run on both: every stream goes on on the other worker
    with the text of an undisturbed run, the router drops the worker, and Serve replaces it once its health
    check fails."""
    import psutil

    before = set(router_stats(http)["workers"])
    victim = sorted(before)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Worker#{victim}", namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    cores = [p for p in psutil.Process(pid).children() if "engine.core.process" in " ".join(p.cmdline())]
    assert len(cores) == 1, [p.cmdline() for p in psutil.Process(pid).children()]
    bodies = [_story(i) for i in range(16)]
    reference, results = asyncio.run(streams_across_a_kill(str(http.base_url), bodies, cores[0].kill))
    assert [text for text, _ in results] == reference
    print("largest gap between events per stream (s):", sorted(round(gap, 2) for _, gap in results))
    _wait(lambda: victim not in router_stats(http)["workers"], 60, "the router to drop the worker")
    _wait(lambda: set(router_stats(http)["workers"]) - before, 240, "a replacement worker to join", 1.0)


def _stream_last_chunk(base_url: str, i: int, started: threading.Barrier) -> dict:
    """Stream request i (60 tokens); once its first event came, wait at `started`; its last chunk."""
    body = dict(_story(i), max_tokens=60, stream=True)
    with httpx.Client(base_url=base_url, timeout=180) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line)]
        started.wait()
        events += [line for line in lines if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    return json.loads(events[-2][len("data: ") :])


def test_drain_lets_running_streams_finish_and_refuses_new_requests(http):
    """What deploy/serve.sh does on SIGTERM (cluster.shutdown.drain): 8 streams running finish with their
    last token and [DONE]; a request arriving meanwhile gets 503 + Retry-After, /health 503."""
    from cluster.shutdown import drain

    started = threading.Barrier(9)
    with ThreadPoolExecutor(9) as pool:
        streams = [pool.submit(_stream_last_chunk, str(http.base_url), i, started) for i in range(8)]
        started.wait(timeout=240)
        drained = pool.submit(drain, APP, 60)
        _wait(lambda: http.get("/health").status_code == 503, 30, "the ingress to report draining")
        refused = http.post("/v1/completions", json=_story(99))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        last = [s.result(timeout=240) for s in streams]
        assert drained.result(timeout=120) == [8]
    assert all(chunk["choices"][0]["finish_reason"] == "length" for chunk in last), last


def test_shutdown_command_drains_under_serve_sh_environment(cluster):
    """`python -m cluster.shutdown`, as deploy/serve.sh runs it on SIGTERM (its environment: Serve's throughput
    preset), reaches the ingress replica (already drained by the test before: it reports 0 running)."""
    env = {**os.environ, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "cluster.shutdown", "--app", APP, "--grace-s", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "drained 1 ingress replica(s), 0 request(s) were running" in done.stdout, done.stdout
