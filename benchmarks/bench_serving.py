"""Online serving benchmark for any OpenAI-compatible endpoint (radixserve, vLLM, SGLang, ...).

Streams every request (SSE) and measures, per request: TTFT, ITL, E2E latency, TPOT and output
tokens (from `usage`); overall: request and token throughput, p50/p90/p99 of each latency, and the
prefix-cache hit rate — client-side from `usage.prompt_tokens_details.cached_tokens`, and
server-side from radixserve's /router/stats (cluster) or /metrics (single node), or vLLM's
`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` counters, as the change over the run.

Token events are counted as vLLM's own client (`vllm bench serve`, vllm/benchmarks/lib/
endpoint_request_func.py) counts them: every streamed chunk whose `choices` list is non-empty is one
token event, whatever its text (a chat stream's role chunk, a token whose text is empty or held back
mid-UTF-8, a finish chunk); the first sets TTFT, each later one adds an ITL gap. A chunk with
`choices: []` (the final usage chunk) is no event; its `usage` gives the prompt, cached and output
token counts. So ITL is the time between the chunks a server sends, and a server that sends no chunk
for a token (e.g. one whose text is empty) shows a longer gap there; `events_per_output_token` in the
summary (chunks with choices / output tokens from usage) shows how many tokens went without a chunk.
TPOT (per request: (E2E - TTFT) / (output tokens - 1), requests with more than one output token)
does not depend on chunking.

Datasets (fixed seeds; prompts are words drawn from a fixed vocabulary, ~1 token per word):
  random         --num-prompts completions with input lengths uniform in
                 [--input-len * (1 - --range-ratio), --input-len]
  shared-prefix  --num-groups system prompts of --system-prompt-len words, each followed by
                 --prompts-per-group questions of --question-len words (chat); shuffled
  multi-turn     --num-conversations chats of --num-turns turns; each turn sends the whole
                 conversation so far (earlier answers included) plus a new --question-len question;
                 --history generated: the earlier answers are the server's own text; dataset: a fixed
                 --output-len-word answer per turn, so that servers whose outputs differ (dummy
                 weights) are sent the same prompts

Load: --request-rate R (Poisson arrivals, requests/s; inf = all at once) and/or
--max-concurrency C (at most C requests in flight). Multi-turn conversations run concurrently;
the turns of one conversation run in order. Each request in flight has an HTTP client and a
keep-alive connection of its own (Lanes): one shared httpx client's connection pool scans all its
connections and queued requests whenever a request starts or ends, so with hundreds in flight the
client itself fell seconds behind whenever many requests ended together.

  python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --dataset shared-prefix \
      --num-groups 8 --prompts-per-group 16 --system-prompt-len 512 --question-len 32 --output-len 64 \
      --max-concurrency 16

Writes JSON to benchmarks/results/ (and a PNG of the latency distributions when matplotlib is
installed). Prints a table; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import httpx

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


# --- workloads ---------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request: a completions prompt or chat messages (multi-turn: filled in as answers arrive)."""

    prompt: Optional[str] = None
    messages: Optional[List[Dict[str, str]]] = None
    question: Optional[str] = None
    """multi-turn: this turn's user message; the conversation so far is prepended at send time."""
    answer: Optional[str] = None
    """multi-turn with --history dataset: the assistant message that follows this turn in the history (None:
    the server's answer)."""


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def make_workload(args) -> List[List[Turn]]:
    """A list of sessions; each session is a list of turns sent in order (one turn for single-shot)."""
    rng = random.Random(args.seed)
    if args.dataset == "random":
        low = max(1, int(args.input_len * (1 - args.range_ratio)))
        return [[Turn(prompt=_text(rng, rng.randint(low, args.input_len)))] for _ in range(args.num_prompts)]
    if args.dataset == "shared-prefix":
        sessions = []
        for g in range(args.num_groups):
            system = f"You are assistant number {g}. " + _text(rng, args.system_prompt_len)
            for _ in range(args.prompts_per_group):
                sessions.append(
                    [
                        Turn(
                            messages=[
                                {"role": "system", "content": system},
                                {"role": "user", "content": _text(rng, args.question_len)},
                            ]
                        )
                    ]
                )
        rng.shuffle(sessions)
        return sessions
    if args.dataset == "multi-turn":
        fixed = args.history == "dataset"
        return [
            [
                Turn(question=_text(rng, args.question_len), answer=_text(rng, args.output_len) if fixed else None)
                for _ in range(args.num_turns)
            ]
            for _ in range(args.num_conversations)
        ]
    raise ValueError(f"unknown dataset {args.dataset!r}")


# --- one request -------------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: List[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""
    pieces: List[str] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    key: str = ""
    """"<session>.<turn>": the same request across runs of one workload."""

    def add_text(self, text: str) -> None:
        """A token event arrived (a streamed chunk with choices; `text` may be empty): the first sets
        TTFT, later ones add an inter-token latency."""
        now = time.perf_counter()
        if not self.pieces:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.pieces.append(text)

    def finish(self) -> "Result":
        self.e2e = time.perf_counter() - self.start
        self.text = "".join(self.pieces)
        self.output_tokens = self.output_tokens or len(self.pieces)
        self.ok = True
        return self


async def send(client: httpx.AsyncClient, args, turn: Turn, history: List[Dict[str, str]]) -> Result:
    common = {
        "model": args.model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        common["ignore_eos"] = True
    if turn.prompt is not None:
        url, body = "/v1/completions", {**common, "prompt": turn.prompt}
    else:
        messages = turn.messages or history + [{"role": "user", "content": turn.question}]
        url, body = "/v1/chat/completions", {**common, "messages": messages}
    res = Result(ok=False)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                choices = chunk.get("choices")
                if choices:  # one token event, even with empty text (module docstring)
                    text = ""
                    for choice in choices:
                        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    res.add_text(text)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    return res.finish()


# --- load generation ---------------------------------------------------------------------------


class Lanes:
    """HTTP clients for the requests in flight, one request per client at a time, each client holding one
    keep-alive connection. httpcore's connection pool walks every connection of its client and every queued
    request on each request start and end (quadratic in the requests in flight); with one connection per
    client that walk is constant, and a lane freed by a finished request is reused (its connection kept) by
    the next one. Lanes are made on demand, so there are at most as many as requests were ever in flight
    together; `prepare(n)` makes n of them before the clock starts. They share one TLS context (httpx builds
    one per client otherwise, which costs tens of milliseconds each). Owned by one event loop."""

    def __init__(self, **client_kwargs: Any):
        self._kwargs = {"verify": httpx.create_ssl_context(), **client_kwargs}
        self._idle: List[httpx.AsyncClient] = []
        self._all: List[httpx.AsyncClient] = []

    def take(self) -> httpx.AsyncClient:
        if self._idle:
            return self._idle.pop()  # the most recently used: its connection is the likeliest to be alive
        self._all.append(self._new())
        return self._all[-1]

    def prepare(self, n: int) -> None:
        """Make idle lanes until there are `n`."""
        while len(self._all) < n:
            self._all.append(self._new())
            self._idle.append(self._all[-1])

    def _new(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), **self._kwargs)

    def give(self, client: httpx.AsyncClient) -> None:
        self._idle.append(client)

    def __len__(self) -> int:
        return len(self._all)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()


async def run_load(args, sessions: List[List[Turn]]) -> tuple:
    from tqdm.asyncio import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)
    total = sum(len(s) for s in sessions)
    results: List[Result] = []
    bar = tqdm(total=total, desc=f"{args.dataset}", unit="req")

    lanes = Lanes(base_url=args.base_url, timeout=args.timeout, headers=headers)
    lanes.prepare(min(args.max_concurrency or 0, total))
    try:

        async def on_a_lane(turn: Turn, history: List[Dict[str, str]]) -> Result:
            client = lanes.take()
            try:
                return await send(client, args, turn, history)
            finally:
                lanes.give(client)

        async def one(turn: Turn, history: List[Dict[str, str]], key: str) -> Result:
            if sem is None:
                res = await on_a_lane(turn, history)
            else:
                async with sem:
                    res = await on_a_lane(turn, history)
            res.key = key
            results.append(res)
            bar.update(1)
            return res

        async def session(turns: List[Turn], index: int) -> None:
            history: List[Dict[str, str]] = []
            for t, turn in enumerate(turns):
                res = await one(turn, history, f"{index}.{t}")
                if turn.question is not None:
                    history = history + [
                        {"role": "user", "content": turn.question},
                        {"role": "assistant", "content": res.text if turn.answer is None else turn.answer},
                    ]

        tasks = []
        start = time.perf_counter()
        for index, s in enumerate(sessions):
            tasks.append(asyncio.ensure_future(session(s, index)))
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        await lanes.aclose()
    bar.close()
    return results, duration


# --- server-side cache statistics --------------------------------------------------------------


def server_cache_counters(base_url: str, api_key: Optional[str]) -> Optional[Dict[str, float]]:
    """(prompt_tokens, cached_tokens) summed over the server's workers, or None if not exposed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url}/router/stats", headers=headers, timeout=10)
        if r.status_code == 200:
            # Decode replicas (the receivers of the handoffs) count received prompts again: the computing pools only.
            ws = [w for w in r.json()["workers"].values() if w.get("pool") != "decode"]
            return {
                "source": "router_stats",
                "prompt_tokens": sum(w["engine"].get("prompt_tokens", 0) for w in ws),
                "cached_tokens": sum(w["engine"].get("cached_tokens", 0) for w in ws),
                "workers": len(ws),
            }
        r = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
        if r.status_code == 200:

            def total(name: str) -> float:
                return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", r.text, re.M))

            if re.search(r"^radixserve_prompt_tokens", r.text, re.M):
                return {
                    "source": "metrics",
                    "prompt_tokens": total("radixserve_prompt_tokens"),
                    "cached_tokens": total("radixserve_cached_prompt_tokens"),
                }
            if re.search(r"^vllm:prefix_cache_queries", r.text, re.M):
                # vLLM's prefix cache counters (tokens looked up / tokens found), summed over its engines.
                return {
                    "source": "vllm_metrics",
                    "prompt_tokens": total("vllm:prefix_cache_queries"),
                    "cached_tokens": total("vllm:prefix_cache_hits"),
                }
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    return None


# --- summary -----------------------------------------------------------------------------------


def pcts(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, round(p * (len(s) - 1)))]

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(results: List[Result], duration: float, before, after) -> Dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "total_throughput_tok_s": (out_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": {k: v * 1e3 for k, v in pcts([r.ttft for r in ok]).items()},
        "itl_ms": {k: v * 1e3 for k, v in pcts([x for r in ok for x in r.itl]).items()},
        "e2e_ms": {k: v * 1e3 for k, v in pcts([r.e2e for r in ok]).items()},
        "tpot_ms": {
            k: v * 1e3
            for k, v in pcts([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]).items()
        },
        "events_per_output_token": (sum(len(r.pieces) for r in ok) / out_tokens) if out_tokens else 0.0,
        "client_cache_hit_rate": (sum(r.cached_tokens for r in ok) / prompt_tokens) if prompt_tokens else 0.0,
    }
    if before is not None and after is not None:
        dp = after["prompt_tokens"] - before["prompt_tokens"]
        summary["server_cache_hit_rate"] = (after["cached_tokens"] - before["cached_tokens"]) / dp if dp else 0.0
        summary["server_cache_source"] = after["source"]
    return summary


def timeline(results: List[Result]) -> Dict[str, List[float]]:
    """Every request in the order they were sent, as columns: when it was sent (s after the first), its TTFT
    and E2E (ms; 0 for a failed request) and its prompt and cached tokens. Shows what percentiles hide: requests
    that arrive and finish in waves (a closed-loop client on same-length requests)."""
    ordered = sorted(results, key=lambda r: r.start)
    first = ordered[0].start if ordered else 0.0
    return {
        "sent_s": [round(r.start - first, 4) for r in ordered],
        "ttft_ms": [round(r.ttft * 1e3, 2) if r.ok else 0.0 for r in ordered],
        "e2e_ms": [round(r.e2e * 1e3, 2) if r.ok else 0.0 for r in ordered],
        "prompt_tokens": [r.prompt_tokens for r in ordered],
        "cached_tokens": [r.cached_tokens for r in ordered],
    }


def print_table(summary: Dict[str, Any]) -> None:
    print(f"\n{'requests (ok/total)':<28}{summary['completed']}/{summary['requests']}")
    print(f"{'duration':<28}{summary['duration_s']:.2f} s")
    print(f"{'request throughput':<28}{summary['request_throughput']:.2f} req/s")
    print(f"{'output throughput':<28}{summary['output_throughput_tok_s']:.1f} tok/s")
    print(f"{'total throughput':<28}{summary['total_throughput_tok_s']:.1f} tok/s")
    print(f"{'':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("itl_ms", "ITL (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("e2e_ms", "E2E (ms)"),
    ):
        v = summary[key]
        print(f"{label:<28}{v['mean']:>10.1f}{v['p50']:>10.1f}{v['p90']:>10.1f}{v['p99']:>10.1f}")
    print(f"{'stream events / token':<28}{summary['events_per_output_token']:.3f}")
    print(f"{'cache hit rate (client)':<28}{summary['client_cache_hit_rate']:.3f}")
    if "server_cache_hit_rate" in summary:
        print(
            f"{'cache hit rate (server)':<28}{summary['server_cache_hit_rate']:.3f} ({summary['server_cache_source']})"
        )
    for e in summary["errors"]:
        print("error:", e)


def plot(results: List[Result], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install -e '.[bench]')")
        return None
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, xs) in zip(
        axes, (("TTFT", [r.ttft for r in ok]), ("ITL", [x for r in ok for x in r.itl]), ("E2E", [r.e2e for r in ok]))
    ):
        s = sorted(x * 1e3 for x in xs)
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))] if s else [])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    """The load generator's options (also used by bench_policies.py)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root (without /v1).")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))
    p.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn"], default="shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64, help="random: number of requests.")
    p.add_argument("--input-len", type=int, default=256, help="random: max input length (words).")
    p.add_argument("--range-ratio", type=float, default=0.5, help="random: input lengths in [len*(1-r), len].")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts.")
    p.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: questions per system prompt.")
    p.add_argument("--system-prompt-len", type=int, default=256, help="shared-prefix: system prompt words.")
    p.add_argument("--question-len", type=int, default=16, help="shared-prefix / multi-turn: question words.")
    p.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations.")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation.")
    p.add_argument(
        "--history",
        choices=["generated", "dataset"],
        default="generated",
        help="multi-turn: earlier answers in the history are the server's text, or fixed dataset text.",
    )
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of every request.")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send ignore_eos so every output has --output-len tokens (radixserve, vLLM, SGLang).",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrival rate (req/s); inf: all at once."
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="Max requests in flight.")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="Free text stored in the JSON (server, hardware, policy).")
    p.add_argument("--out", default=None, help="JSON path; default benchmarks/results/serving_<dataset>.json.")
    return p


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)

    sessions = make_workload(args)
    before = server_cache_counters(args.base_url, args.api_key)
    results, duration = asyncio.run(run_load(args, sessions))
    after = server_cache_counters(args.base_url, args.api_key)
    summary = summarize(results, duration, before, after)
    print_table(summary)

    os.makedirs(RESULTS, exist_ok=True)
    out = args.out or os.path.join(RESULTS, f"serving_{args.dataset}.json")
    client_host = {"python": platform.python_version(), "cpu_count": os.cpu_count(), "machine": platform.machine()}
    record = {
        "args": {k: (None if v == math.inf else v) for k, v in vars(args).items() if k != "api_key"},
        "client_host": client_host,
        "summary": summary,
        "server_cache_before": before,
        "server_cache_after": after,
        "requests": [
            {k: v for k, v in asdict(r).items() if k not in ("text", "itl", "pieces", "start", "last")} for r in results
        ],
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")
    png = plot(results, os.path.splitext(out)[0] + ".png", f"{args.dataset} {args.label}".strip())
    if png:
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
