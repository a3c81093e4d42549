"""Continuation: a request whose worker died mid-stream goes on elsewhere from its tokens so far; and, in
mode=disaggregated, how the ingress retries: each attempt under an id of its own, aborts reaching the live
attempt, a prefill failing on every attempt as a 503 no_workers. The end-to-end runs (a worker or a decode
replica killed under 16 streams) are in test_cluster.py and test_disaggregated_admin.py."""

import asyncio
import json

import httpx
import pytest

pytest.importorskip("ray")

from cluster.ingress.backend import Continuation  # noqa: E402
from cluster.ingress.disaggregated import DisaggregatedBackend  # noqa: E402
from cluster.router.policies import NoWorkersError, RoutingDecision  # noqa: E402
from cluster.router.router import PairDecision  # noqa: E402
from cluster.workers.base import WorkerItem  # noqa: E402
from cluster.workers.handoff import PrefillFailedError  # noqa: E402
from engine.errors import EngineDeadError, InvalidRequestError  # noqa: E402
from engine.outputs import StreamOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def _out(tokens, completion, prompt=5, cached=2, finish=None):
    return StreamOutput("r", 0, tokens, "", None, finish, None, prompt, cached, completion)


def test_next_attempt_carries_the_tokens_so_far_and_what_is_left_of_the_budget():
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    c = Continuation([1, 2, 3, 4, 5], params)
    assert c.attempt() == ([1, 2, 3, 4, 5], params)
    assert c.seen(_out([7], 1)).completion_tokens == 1
    c.seen(_out([8, 9], 3))
    ids, resumed = c.attempt()
    assert ids == [1, 2, 3, 4, 5, 7, 8, 9] and resumed.max_new_tokens == 7 and resumed.temperature == 0.0
    # the new worker counts from its own prompt; the client sees one request
    out = c.seen(_out([10], 1, prompt=8, cached=8))
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (5, 4, 2)
    assert out.new_token_ids == [10]
    assert c.attempt()[0] == [1, 2, 3, 4, 5, 7, 8, 9, 10] and c.attempt()[1].max_new_tokens == 6


@pytest.mark.parametrize(
    "params, resumable",
    [
        (SamplingParams(), True),
        (SamplingParams(n=2), False),
        (SamplingParams(json_schema='{"type": "object"}'), False),
        (SamplingParams(regex="[a-z]+"), False),
        (SamplingParams(prompt_logprobs=1), False),
    ],
)
def test_only_what_can_be_resumed_is(params, resumable):
    c = Continuation([1, 2], params)
    assert c.resumable is resumable
    assert c.seen(_out([7, 8], 2)).new_token_ids == [7, 8]
    assert c.generated == ([7, 8] if resumable else [])  # tokens are kept only for a request that may resume
    assert c.attempt()[0] == ([1, 2, 7, 8] if resumable else [1, 2])


# ---- retries in mode=disaggregated ----------------------------------------------------------------------
# The ingress's DisaggregatedBackend (real, with its WorkerStreams and Continuation) over stand-ins of its
# Serve handles. Each replica's engine is an _Engine: it refuses a request id that an earlier request
# still holds there, as engine.Engine does. What a decode replica does with each request it gets is
# scripted (one plan per submit, in order); the end-to-end runs are in test_disaggregated.py.


class _Engine:
    """A replica's engine as far as request ids go (engine.Engine._submit): an id is held from its submit
    until its request ends there; a submit under an id still held is refused."""

    def __init__(self):
        self.held, self.submitted = set(), []

    def submit(self, rid):
        if rid in self.held:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        self.held.add(rid)
        self.submitted.append(rid)


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Handle:
    """A DeploymentHandle: `.options(...).<method>.remote(*args)` calls `pool.<method>(*args)` (every call
    names its replica among its arguments)."""

    def __init__(self, pool):
        self._pool = pool

    def options(self, **_):
        return self

    def __getattr__(self, name):
        return _Method(getattr(self._pool, name))


class _Router:
    """Pairs prefill replica P with the first decode replica neither reported dead nor excluded."""

    def __init__(self, decodes):
        self.decodes, self.dead = list(decodes), set()
        self.routed, self.finished = [], []
        self.route_pair = _Method(self._route_pair)
        self.finish_many = _Method(self._finish_many)
        self.report_dead = _Method(self._report_dead)

    async def _route_pair(self, ids, rid, exclude_decode=()):
        self.routed.append(rid)
        live = [d for d in self.decodes if d not in self.dead and d not in exclude_decode]
        if not live:
            raise NoWorkersError("the decode pool is empty")
        return PairDecision(RoutingDecision("P", 0, "test"), RoutingDecision(live[0], 0, "test"))

    async def _finish_many(self, items):
        self.finished += [(item.worker_id, item.pool) for item in items]
        return [None] * len(items)

    async def _report_dead(self, worker_id, pool):
        self.dead.add(worker_id)


class _PrefillPool:
    """Prefill replica P: its engine holds the id of each prompt it computes until the KV is handed over."""

    def __init__(self):
        self.engine, self.started = _Engine(), set()

    async def start_prefill(self, ids, params, rid, key, replica):
        self.engine.submit(key)
        self.started.add(key)

    async def forget_prefill(self, key):
        if key in self.started:
            self.started.discard(key)
            self.engine.held.discard(key)

    def prefill(self, rid, early_key):
        """A decode replica's prefill call (PrefillWorker.prefill): claims the started prompt, else computes
        it under an id; returns the engine's id of it (held until released)."""
        if early_key in self.started:
            self.started.discard(early_key)
            return early_key
        engine_rid = f"{early_key}~" if early_key else rid
        self.engine.submit(engine_rid)
        return engine_rid


class _DecodePool:
    """Decode replicas: each an _Engine and a stream to the ingress; `plans`, one per submit in order (then
    every request decodes normally)."""

    def __init__(self, prefill, plans, replicas):
        self.prefill, self.plans = prefill, list(plans)
        self.engines = {d: _Engine() for d in replicas}
        self.queues = {d: asyncio.Queue() for d in replicas}
        self.aborted, self.running = [], set()

    def outputs(self, ingress_id, replica):
        return _Stream(self.queues[replica])

    async def submit_disaggregated(self, ids, params, rid, prefill_id, early_key, ingress_id, replica):
        plan = self.plans.pop(0) if self.plans else _decodes
        task = asyncio.ensure_future(plan(_Attempt(self, replica, rid, early_key, ids, params)))  # its "pump"
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def abort(self, rid, replica):
        self.aborted.append((rid, replica))


class _Stream:
    """A worker's batched output stream (a Serve streaming call)."""

    def __init__(self, queue):
        self.queue = queue

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        while True:
            batch = await self.queue.get()
            if batch is None:  # the stream ends (its replica is shutting down)
                return
            yield batch

    def cancel(self):
        pass


class _Attempt:
    """One submit on a decode replica, as its plan sees it."""

    def __init__(self, pool, replica, rid, early_key, ids, params):
        self.pool, self.replica, self.rid, self.early_key = pool, replica, rid, early_key
        self.ids, self.params = ids, params

    def put(self, output=None, error=None):
        self.pool.queues[self.replica].put_nowait([WorkerItem(self.rid, output=output, error=error)])

    def start(self, release_prefill=True) -> bool:
        """The decode engine takes the request and has P compute the prompt; False (the error sent) when an
        engine refuses it (DecodeWorker: a refused prefill call is a PrefillFailedError)."""
        try:
            self.pool.engines[self.replica].submit(self.rid)
        except InvalidRequestError as exc:
            self.put(error=exc)
            return False
        try:
            engine_rid = self.pool.prefill.prefill(self.rid, self.early_key)
        except InvalidRequestError as exc:
            self.pool.engines[self.replica].held.discard(self.rid)
            self.put(error=PrefillFailedError(f"remote prefill on P failed: {exc!r}", "P", False))
            return False
        if release_prefill:
            self.pool.prefill.engine.held.discard(engine_rid)
        return True

    async def stream(self, count=None):
        """The greedy continuation of the prompt (TOKENS after PROMPT), `count` tokens of it (None: to the end
        of the request's budget)."""
        done = len(self.ids) - len(PROMPT)
        budget = self.params.max_new_tokens
        for i, token in enumerate(TOKENS[done : done + budget][:count]):
            finish = "length" if i == budget - 1 else None
            self.put(output=StreamOutput(self.rid, 0, [token], "", None, finish, None, len(self.ids), 0, i + 1))
            await asyncio.sleep(0)
        if count is None:
            self.pool.engines[self.replica].held.discard(self.rid)


async def _decodes(a):
    if a.start():
        await a.stream()


def _prefill_fails(held):
    """The prefill fails (the transfer into this replica, or P refused); `held`: the decode engine has not yet
    confirmed the request's abort (its core stalls: a tensor-parallel rank just died), so the id is still in use."""

    async def plan(a):
        if a.start():
            if not held:
                a.pool.engines[a.replica].held.discard(a.rid)
            a.put(error=PrefillFailedError("remote prefill on P failed: transfer failed", "P", False))

    return plan


async def _dies_while_prefilling(a):
    """The decode engine dies while P computes the prompt: P's call goes on (it holds its id there)."""
    if a.start(release_prefill=False):
        a.put(error=EngineDeadError("the engine loop stopped"))


def _streams_then(count, dies=False, stream_ends=False):
    """`count` tokens, then: the engine dies (`dies`), the replica's stream ends (`stream_ends`), or nothing."""

    async def plan(a):
        if a.start():
            await a.stream(count)
            if dies:
                a.put(error=EngineDeadError("the engine loop stopped"))
            if stream_ends:
                a.pool.queues[a.replica].put_nowait(None)

    return plan


PROMPT: list = []
TOKENS: list = []


@pytest.fixture(scope="module")
def tokenizer():
    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    PROMPT[:] = tok.encode("Once upon a time", add_special_tokens=False)
    TOKENS[:] = tok.encode(" there was a small village by the sea", add_special_tokens=False)[:6]
    return tok


def _disaggregated(tokenizer, plans, decodes=("D1", "D2"), early_prefill=True):
    """(backend, router, decode pool, prefill pool) of a cluster of prefill replica P and `decodes`."""
    router, prefill = _Router(decodes), _PrefillPool()
    decode = _DecodePool(prefill, plans, decodes)
    early = _Handle(prefill) if early_prefill else None
    backend = DisaggregatedBackend(router, _Handle(decode), tokenizer, 2048, tokenizer.vocab_size, prefill=early)
    return backend, router, decode, prefill


def _greedy(n=6):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


async def _text(gen):
    return "".join([out.text async for out in gen])


async def _settled():
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("early_prefill", [True, False])
def test_a_retry_on_the_same_decode_replica_runs_under_an_id_of_its_own(tokenizer, early_prefill):
    """The prefill fails while the decode replica's engine still holds the attempt's id: the retry reaches
    the same replica (the only one) under an id of its own; the router and the client see one request."""
    backend, router, decode, _ = _disaggregated(tokenizer, [_prefill_fails(held=True), _decodes], ("D",), early_prefill)

    async def run():
        text = await asyncio.wait_for(_text(backend.generate_stream(PROMPT, _greedy(), "r1")), 30)
        await _settled()
        return text

    assert asyncio.run(run()) == tokenizer.decode(TOKENS)
    first, second = decode.engines["D"].submitted
    assert first == "r1" and second != first
    assert router.routed == ["r1", "r1"]  # the router counts the client's request
    assert sorted(router.finished) == sorted([("P", "prefill"), ("D", "decode")] * 2)


def test_a_retry_after_a_decode_replica_died_reaches_the_prefill_replica_under_an_id_of_its_own(tokenizer):
    """The decode replica's engine dies while P computes the prompt (without early_prefill, under the request's
    id there): P's call goes on, so the retry's prefill call (from the other decode replica) needs an id of its
    own on P."""
    backend, router, decode, prefill = _disaggregated(
        tokenizer, [_dies_while_prefilling, _decodes], early_prefill=False
    )
    text = asyncio.run(asyncio.wait_for(_text(backend.generate_stream(PROMPT, _greedy(), "r2")), 30))
    assert text == tokenizer.decode(TOKENS)
    assert router.dead == {"D1"}
    first, second = prefill.engine.submitted
    assert first == "r2" and second != first
    assert decode.engines["D2"].submitted == [second]  # each attempt has one id on both sides


@pytest.mark.parametrize("how", ["abort", "disconnect"])
def test_aborting_a_retried_request_aborts_its_live_attempt(tokenizer, how):
    """After a retry, aborting the client's request (by its id, or by closing its stream) aborts the attempt
    that is live, under its own id, on its replica; the router is told once per attempt."""
    backend, router, decode, _ = _disaggregated(tokenizer, [_prefill_fails(held=True), _streams_then(2)], ("D",))

    async def run():
        gen = backend.generate_stream(PROMPT, _greedy(), "r3")
        first = await asyncio.wait_for(gen.__anext__(), 30)
        if how == "abort":
            backend.abort("r3")
        await gen.aclose()
        await _settled()
        return first

    assert asyncio.run(run()).new_token_ids == TOKENS[:1]
    live = decode.engines["D"].submitted[-1]
    assert live != "r3" and decode.aborted == [(live, "D")]
    assert sorted(router.finished) == sorted([("P", "prefill"), ("D", "decode")] * 2)


def test_a_stream_that_ends_hands_its_requests_on(tokenizer):
    """A decode replica's stream that ends without an error (its replica is going away) fails the requests
    still open on it as a dead replica's: the request goes on elsewhere from its tokens so far."""
    backend, router, _, _ = _disaggregated(tokenizer, [_streams_then(2, stream_ends=True)])
    text = asyncio.run(asyncio.wait_for(_text(backend.generate_stream(PROMPT, _greedy(), "r4")), 30))
    assert text == tokenizer.decode(TOKENS)
    assert router.dead == {"D1"}


@pytest.fixture(scope="module")
def serving(tokenizer):
    """serve(app) of build_app over a DisaggregatedBackend: call it with the backend."""
    from serving.app import build_app
    from serving_harness import serve

    return lambda backend: serve(build_app(backend, model_name="m"))


def _error(body: dict, headers) -> tuple:
    e = body["error"]
    return e["type"], e["code"], headers.get("retry-after")


def test_prefill_failing_on_every_attempt_is_a_503_like_no_workers(tokenizer, serving):
    """Every attempt's prefill failed: a 503 with Retry-After, of the same type and code as the router's
    no_workers (the cluster cannot take the request now; the client may retry)."""
    failing, _, _, _ = _disaggregated(tokenizer, [_prefill_fails(held=False)] * 3, ("D",))
    empty, _, _, _ = _disaggregated(tokenizer, [], ())
    body = dict(model="m", prompt=PROMPT, max_tokens=6, temperature=0.0)
    answers = []
    for backend in (failing, empty):
        with serving(backend) as url, httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            answers.append(_error(r.json(), r.headers))
    assert answers[0] == answers[1] == ("service_unavailable", "no_workers", "1")


def test_prefill_failing_after_a_cut_mid_stream_is_a_no_workers_error_event(tokenizer, serving):
    """The decode replica dies mid-stream and the continuation's prefill then fails on every attempt left:
    the stream, already started, ends with an error event of the no_workers type, then [DONE]."""
    plans = [_streams_then(2, dies=True), _prefill_fails(held=False), _prefill_fails(held=False)]
    backend, router, _, _ = _disaggregated(tokenizer, plans)
    body = dict(model="m", prompt=PROMPT, max_tokens=6, temperature=0.0, stream=True)
    with serving(backend) as url, httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == tokenizer.decode(TOKENS[:2])
    error = chunks[-1]["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "no_workers")
    assert router.dead == {"D1"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_replica_leaves_on_every_attempt_ends_as_no_workers(tokenizer, serving, stream):
    """Each of the three attempts' decode replicas leaves (its stream ends: the replica is gone) after
    `tokens` tokens: the request ends as the router's no_workers does, a 503 with Retry-After before the
    first token, an error event of that type (then [DONE]) in a stream already started; not a 500."""
    tokens = 1 if stream else 0
    plans = [_streams_then(tokens, stream_ends=True)] * 3
    backend, router, _, _ = _disaggregated(tokenizer, plans, ("D1", "D2", "D3"))
    body = dict(model="m", prompt=PROMPT, max_tokens=6, temperature=0.0, stream=stream)
    with serving(backend) as url, httpx.Client(base_url=url, timeout=60) as http:
        if not stream:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            assert _error(r.json(), r.headers) == ("service_unavailable", "no_workers", "1")
        else:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "no_workers")
    assert router.dead == {"D1", "D2", "D3"}


def test_a_request_id_in_flight_here_or_with_the_attempt_separator_is_refused(tokenizer):
    """A client's request id (SGLang's /generate takes one) is refused before routing while a request of this
    ingress replica holds it (its worker stream routes outputs by id), or when it carries "@" (later attempts'
    ids): InvalidRequestError, a 400. The request that holds the id is not disturbed."""
    release = asyncio.Event()

    async def waits(a):
        if a.start():
            await release.wait()
            await a.stream()

    backend, router, _, _ = _disaggregated(tokenizer, [waits])

    async def run():
        first = asyncio.ensure_future(_text(backend.generate_stream(PROMPT, _greedy(), "x")))
        await _settled()
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _text(backend.generate_stream(PROMPT, _greedy(), "x"))
        with pytest.raises(InvalidRequestError, match="reserved"):
            await _text(backend.generate_stream(PROMPT, _greedy(), "y@2"))
        release.set()
        text = await first
        return text, await _text(backend.generate_stream(PROMPT, _greedy(), "x"))  # free again once it ended

    first, again = asyncio.run(run())
    assert first == again == tokenizer.decode(TOKENS)
    assert router.routed == ["x", "x"]
