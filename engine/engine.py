"""Engine: the public API of one replica — the front end of an EngineCore.

    Engine.generate / generate_stream / prefill_for_handoff
      validate, tokenize (caller's thread) ──AddRequest──▶ EngineCore: scheduler, model, KV (engine.core)
      ◀── StepOutputs: one message per step with every request's token ids ──
      _dispatch ─▶ per request: StreamOutput, text and stop strings (engine.text.OutputText) ─▶ caller

Where the core runs (`EngineConfig.core_process`): in a thread of this process (the default: offline
use, tests), or in a process of its own that owns the device (servers: `python -m serving` and the
cluster's workers), so that the scheduler never waits on this process's HTTP, text or streams.

Ownership: the core owns every KV page; the front end owns each request's text and delivery. A
stream that stops early (its consumer closed it, a stop string matched here) aborts its request in
the core, which frees its pages; a dead core fails every open request with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Deque, Dict, List, Optional, Sequence, Union

from engine.config import EngineConfig
from engine.core.client import CALL_TIMEOUT_S
from engine.core.messages import AbortRequest, AddRequest, AddRequests, CompleteReceive, ReleaseSent
from engine.errors import (
    EngineAbortedError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    as_dead_error,
)
from engine.models.source import resolve_model
from engine.outputs import EngineStats, GenerateOutput, ReqOutput, StreamOutput
from engine.sampling_params import SamplingParams
from engine.text import OutputText
from engine.tokenizer import load_tokenizer

Prompt = Union[str, Sequence[int]]
RemotePrefill = Callable[[Any], Awaitable[Any]]
"""Disaggregation, the handoff's receiver: has the reserved pages (a KVReservation) filled and returns the
SenderHandoff (see generate_stream)."""
Sink = Callable[[Any], None]
"""Receives a request's items in order: StreamOutputs, a handoff object, or an exception (the end)."""


class _Group:
    """The front end's side of one AddRequest: its choices' text and where their outputs go."""

    def __init__(
        self,
        rid: str,
        params: SamplingParams,
        text: Optional[OutputText],
        sink: Sink,
        loop: Optional[asyncio.AbstractEventLoop],
        handoff: Optional[str],
    ):
        self.rid, self.params, self.text, self.sink, self.loop = rid, params, text, sink, loop
        self.handoff = handoff
        self.engine_rids = [rid] if params.n == 1 else [f"{rid}#{i}" for i in range(params.n)]

    def feed(self, index: int, out: ReqOutput, abort: Callable[[str], None]) -> None:
        """Turn the core's output for choice `index` into what the sink receives (in the sink's thread)."""
        if out.error is not None:
            self.sink(out.error)
            return
        if out.handoff is not None:
            self.sink(out.handoff)
            return
        item: Optional[StreamOutput] = StreamOutput(
            rid=out.rid,
            index=index,
            new_token_ids=out.new_token_ids,
            text="",
            logprobs=out.logprobs if self.params.logprobs else None,
            finish_reason=None if out.finish_reason is None else out.finish_reason.value,
            matched_stop=out.matched_stop,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=out.completion_tokens,
            prompt_logprobs=out.prompt_logprobs,
        )
        if self.text is not None:
            item = self.text.apply(item)
            if item is None:  # the choice already ended here (a stop string); the core's late news
                return
            if self.text.stopped_here(item):
                abort(out.rid)
        self.sink(item)


@dataclass(frozen=True)
class _Entry:
    group: _Group
    index: int


class _Collector:
    """Sink of the sync API: collects a group's choices until each has finished (or one failed)."""

    def __init__(self, n: int):
        self.outputs: List[List[StreamOutput]] = [[] for _ in range(n)]
        self.open = n
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def __call__(self, item: Any) -> None:
        if isinstance(item, BaseException):
            self.error = self.error or item
            self.done.set()
            return
        self.outputs[item.index].append(item)
        if item.finish_reason is not None:
            self.open -= 1
            if self.open == 0:
                self.done.set()

    def results(self) -> List[GenerateOutput]:
        if self.error is not None:
            raise self.error
        return [_merge(i, outs) for i, outs in enumerate(self.outputs)]


def _merge(index: int, outs: List[StreamOutput]) -> GenerateOutput:
    last = outs[-1]
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return GenerateOutput(
        rid=last.rid,
        index=index,
        text="".join(o.text for o in outs),
        token_ids=[t for o in outs for t in o.new_token_ids],
        finish_reason=last.finish_reason,
        matched_stop=last.matched_stop,
        prompt_tokens=last.prompt_tokens,
        cached_tokens=last.cached_tokens,
        completion_tokens=last.completion_tokens,
        logprobs=logprobs or None,
        prompt_logprobs=prompt_logprobs,
    )


class Engine:
    def __init__(self, model: Optional[str] = None, **config: Any):
        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.source = resolve_model(model)
        self.tokenizer = (
            None
            if self.config.skip_tokenizer_init
            else load_tokenizer(resolve_model(self.config.tokenizer) if self.config.tokenizer else self.source)
        )
        self._requests: Dict[str, _Entry] = {}
        """Engine rid → its group and choice, until the core reports that choice over."""
        self._seed_rng = random.Random(self.config.random_seed)
        self._mapped_kv_pool: Any = None
        """The core process's KV pool mapped into this process (kv_pool_rows), once asked for."""
        self.core = self._start_core()
        info = self.core.info
        self.info = info
        self.context_len, self.vocab_size, self.eos_token_ids = info.context_len, info.vocab_size, info.eos_token_ids

    def _start_core(self) -> Any:
        if self.config.core_process:
            from engine.core.process import ProcessCore

            return ProcessCore(self.config, self._dispatch, self._on_dead)
        from engine.core.core import EngineCore
        from engine.core.local import ThreadCore

        return ThreadCore(EngineCore(self.config, self.source, self.tokenizer), self._dispatch, self._on_dead)

    # ---- public API ------------------------------------------------------------------------
    def generate(
        self, prompt: Union[Prompt, Sequence[Prompt]], sampling_params: Any = None, rid: Optional[str] = None
    ) -> Union[GenerateOutput, List[GenerateOutput]]:
        """Run prompts to completion (blocking).

        `prompt`: a string, a list of token ids, or a list of either (a batch).
        `sampling_params`: a SamplingParams, a dict, or a list of them (one per prompt).
        Returns a GenerateOutput for one prompt with n == 1, else a flat list
        (prompt-major: prompt 0 choices 0..n-1, prompt 1 ...).
        """
        prompts, single = self._as_batch(prompt)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        checked = [(self._check_prompt(p, sp), sp) for p, sp in zip(prompts, params_list)]
        self.core.raise_if_dead()
        self._admit(sum(params.n for _, params in checked))
        collectors, adds = [], []
        for ids, params in checked:
            collector = _Collector(params.n)
            self._submit(ids, params, rid if single else None, collector, None, batch=adds)
            collectors.append(collector)
        # One message: the whole batch is queued before the scheduler's next step, so its batches (and so
        # the rounding of every request's numbers) are the same in every run.
        self.core.send(AddRequests(tuple(adds)))
        for collector in collectors:
            while not self.core.wait(collector.done, 0.5):
                self.core.raise_if_dead()
        outs = [o for c in collectors for o in c.results()]
        return outs[0] if single and len(outs) == 1 else outs

    async def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: Any = None,
        rid: Optional[str] = None,
        remote_prefill: Optional[RemotePrefill] = None,
        coalesce: bool = False,
    ) -> AsyncIterator[StreamOutput]:
        """Yield StreamOutputs (one per engine step with news, per choice) until every choice finishes.
        Cancelling the iterator (client disconnect) aborts the request and frees its pages.

        `coalesce`: when the consumer falls behind, the outputs of one choice that are already waiting, one
        after the other, are yielded as one (StreamOutput.then), so a slow consumer (a loaded HTTP server)
        handles fewer, larger deltas instead of falling further behind; tokens, text and finish are the same.

        `remote_prefill` (disaggregation, the handoff's receiver; n must be 1): the prompt is not computed here.
        Once destination pages are reserved, `await remote_prefill(reservation)` must fill them (a
        KVReservation) and return the SenderHandoff; decoding then continues here. If it raises, the
        request is aborted (pages freed) and the error propagates."""
        loop = asyncio.get_running_loop()
        self.core.attach(loop)
        params = SamplingParams.from_any(sampling_params)
        if remote_prefill is not None and params.n != 1:
            raise InvalidRequestError("n > 1 is not supported with a remote prefill", param="n")
        queue: "asyncio.Queue[Any]" = asyncio.Queue()
        group = self._submit(
            self._check_prompt(prompt, params),
            params,
            rid,
            queue.put_nowait,
            loop,
            handoff="receiver" if remote_prefill is not None else None,
        )
        pending = params.n
        ready: Deque[Any] = deque()
        try:
            while pending:
                if not ready:
                    ready.append(await queue.get())
                while coalesce and not queue.empty():
                    ready.append(queue.get_nowait())
                item = ready.popleft()
                if isinstance(item, BaseException):
                    raise item
                if not isinstance(item, StreamOutput):  # the KVReservation of a remote prefill
                    handoff = await remote_prefill(item)
                    self.core.send(CompleteReceive(group.rid, handoff))
                    continue
                while coalesce and ready and item.continues_with(ready[0]):
                    item = item.then(ready.popleft())
                pending -= item.finish_reason is not None
                yield item
        finally:
            if pending:
                self.abort(group.rid)

    def submit(self, prompt: Prompt, sampling_params: Any, on_output: Sink, rid: Optional[str] = None) -> str:
        """Start a request from a running event loop; returns its rid. `on_output` receives, in order on
        this loop, its StreamOutputs until every choice has a finish_reason, or an exception that ends
        it. Bad input raises here, before anything runs. Stop it with abort(rid)."""
        loop = asyncio.get_running_loop()
        self.core.attach(loop)
        params = SamplingParams.from_any(sampling_params)
        return self._submit(self._check_prompt(prompt, params), params, rid, on_output, loop).rid

    async def prefill_for_handoff(self, prompt: Prompt, sampling_params: Any = None, rid: Optional[str] = None) -> Any:
        """Disaggregation, the handoff's sender: compute the prompt (reusing the radix cache), sample the first
        token, and return a SenderHandoff naming the pages that hold the prompt's KV. Those pages stay
        held until `release_handoff(rid)` — the caller MUST call it once the transfer is over (done or
        failed). Cancelling the call aborts the request (pages freed)."""
        loop = asyncio.get_running_loop()
        self.core.attach(loop)
        params = SamplingParams.from_any(sampling_params)
        if params.n != 1:
            raise InvalidRequestError("n > 1 is not supported with a remote prefill", param="n")
        fut: "asyncio.Future[Any]" = loop.create_future()

        def settle(item: Any) -> None:
            if fut.done():
                return
            if isinstance(item, BaseException):
                fut.set_exception(item)
            elif isinstance(item, StreamOutput):  # the request ended without a handoff: aborted
                fut.set_exception(EngineAbortedError(f"request {item.rid} was aborted before its prefill finished"))
            else:
                fut.set_result(item)

        group = self._submit(self._check_prompt(prompt, params), params, rid, settle, loop, handoff="sender")
        try:
            return await fut
        except BaseException:
            self.abort(group.rid)
            raise

    def release_handoff(self, rid: str) -> None:
        """Sender: the KV transfer of `rid` is over; its pages go to the radix cache."""
        self.core.send(ReleaseSent(rid))

    def abort(self, rid: str) -> None:
        """Abort a request (all choices of it): waiting or running, its pages are freed."""
        if self.core.dead is None:
            self.core.send(AbortRequest(rid))

    def stats(self) -> EngineStats:
        """Running / waiting requests, KV usage, cache hit rate and counters (taken between two steps)."""
        return self.core.call("stats")

    async def stats_async(self, timeout: float = CALL_TIMEOUT_S) -> EngineStats:
        """stats() from an event loop; TimeoutError when the core does not answer within `timeout` s."""
        return await self.core.call_async("stats", timeout=timeout)

    def core_state(self) -> str:
        """One line on where the engine's core stands (its process, the loop reading it, calls waiting): what a
        caller logs when the core did not answer."""
        return self.core.state()

    def drain_cache_events(self) -> list:
        """Radix-cache insert/evict events since the last call (needs enable_cache_events=True)."""
        return self.core.call("drain_cache_events")

    async def drain_cache_events_async(self) -> list:
        return await self.core.call_async("drain_cache_events")

    def start_profile(self, num_steps: Optional[int] = None) -> str:
        """Start a torch profiler trace of the scheduler's loop (needs profile_dir); with `num_steps` it stops
        by itself after that many steps. Returns the trace's path (engine/profiling.py)."""
        return self.core.call("start_profile", num_steps)

    async def start_profile_async(self, num_steps: Optional[int] = None) -> str:
        return await self.core.call_async("start_profile", num_steps)

    def stop_profile(self) -> str:
        """Stop the profile and write its trace; returns the path."""
        return self.core.call("stop_profile")

    async def stop_profile_async(self) -> str:
        return await self.core.call_async("stop_profile")

    def flush_cache(self) -> None:
        """Drop every unlocked cached prefix (for benchmarks)."""
        self.core.call("flush_cache")

    def kv_pool_rows(self) -> Any:
        """The KV pool's memory as (num_slots, values per token), slot rows contiguous (KVPool.slot_rows), for a
        KV transfer backend. With core_process the pool lives in the core's process and is mapped here once
        (needs share_kv_pool on CPU); the mapping is this engine's. Pages may be read or written through it
        only while the core holds them for that transfer (a handoff's sender or receiver)."""
        if getattr(self.core, "core", None) is not None:
            return self.runner.kv_pool.slot_rows()
        if self._mapped_kv_pool is None:
            from engine.memory.kv_pool import map_kv_pool  # noqa: PLC0415

            self._mapped_kv_pool = map_kv_pool(self.core.call("export_kv_pool"))
        return self._mapped_kv_pool.slot_rows()

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the core in this process (offline tools and tests) -----------------------------------
    @property
    def local_core(self) -> Any:
        """The EngineCore when it runs in a thread of this process; its loop thread owns it."""
        core = getattr(self.core, "core", None)
        if core is None:
            raise RuntimeError("the engine core runs in its own process (core_process=True)")
        return core

    @property
    def runner(self) -> Any:
        return self.local_core.runner

    @property
    def scheduler(self) -> Any:
        return self.local_core.scheduler

    @property
    def tree_cache(self) -> Any:
        return self.local_core.tree_cache

    def call_other_ranks(self, module: str, function: str, *args: Any) -> Any:
        """Tensor parallelism, core in this process: every rank but rank 0 runs `module.function(runner, *args)`
        in its step loop, between the steps around it (engine.parallel.step.send_call). Returns at once a
        concurrent Future of the broadcast (it fails when a rank is dead); calls keep their order."""
        runner = self.runner
        return self.core.post_in_loop(lambda: runner.call_other_ranks(module, function, args))

    def _call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """fn() run in the core's loop thread between two steps (tests look at the scheduler so); TimeoutError
        when it has not returned within `timeout` seconds."""
        return self.core.run_in_loop(fn, timeout)

    # ---- request construction (caller's thread) -----------------------------------------------
    @staticmethod
    def _as_batch(prompt) -> tuple:
        if isinstance(prompt, str):
            return [prompt], True
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)], True
        if isinstance(prompt, Sequence) and prompt and all(isinstance(p, (str, list, tuple)) for p in prompt):
            return list(prompt), False
        raise InvalidRequestError(
            "prompt must be a non-empty string, a list of token ids, or a list of those", param="prompt"
        )

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> List[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise InvalidRequestError(
                    f"got {len(sampling_params)} sampling_params for {n} prompts", param="sampling_params"
                )
            return [SamplingParams.from_any(sp) for sp in sampling_params]
        params = SamplingParams.from_any(sampling_params)
        return [params] * n

    def _check_prompt(self, prompt: Prompt, params: SamplingParams) -> List[int]:
        """The prompt's token ids, checked against the vocabulary, the context and the KV pool."""
        params.check_vocab(self.vocab_size)
        if self.tokenizer is None and (params.stop or params.constrained):
            raise InvalidRequestError(
                "stop strings and structured output need a tokenizer (skip_tokenizer_init)",
                param="stop" if params.stop else "json_schema",
            )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this engine has no tokenizer (skip_tokenizer_init): give token ids", param="prompt"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size}), got {bad[:4]}", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.context_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_len} "
                f"(at least one token must be left to generate)",
                param="prompt",
            )
        if len(ids) + self.info.page_size > self.info.kv_capacity_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; the KV pool holds only {self.info.kv_capacity_tokens}",
                param="prompt",
            )
        return ids

    def _submit(
        self,
        ids: List[int],
        params: SamplingParams,
        rid: Optional[str],
        sink: Sink,
        loop: Optional[asyncio.AbstractEventLoop],
        handoff: Optional[str] = None,
        batch: Optional[List[AddRequest]] = None,
    ) -> _Group:
        """Admit and register the group's choices and send it to the core; with `batch`, its AddRequest is
        appended there instead, for the caller, which admitted the whole batch, to send with the others."""
        self.core.raise_if_dead()
        if batch is None:
            self._admit(params.n)
        rid = rid or uuid.uuid4().hex
        text = None
        if self.tokenizer is not None and self.config.detokenize and handoff != "sender":
            text = OutputText(self.tokenizer, ids, params)
        group = _Group(rid, params, text, sink, loop, handoff)
        if any(r in self._requests for r in group.engine_rids):
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        for i, engine_rid in enumerate(group.engine_rids):
            self._requests[engine_rid] = _Entry(group, i)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        add = AddRequest(rid, ids, params, seed, handoff)
        if batch is None:
            self.core.send(add)
        else:
            batch.append(add)
        return group

    def _admit(self, count: int) -> None:
        """Admission control, decided here so a refusal never waits for the core's step: the requests
        registered (submitted and not yet reported finished, so at least what the core holds) plus
        `count` may not exceed max_running_requests + max_queued_requests (None: unbounded)."""
        limit = self.config.admission_limit
        if limit is not None and len(self._requests) + count > limit:
            raise QueueFullError(f"the server is full ({limit} requests in the engine); retry later")

    # ---- delivery (the core's thread, or the event loop the core is attached to) ---------------
    def _dispatch(self, outputs: List[ReqOutput]) -> None:
        """Hand each output to its request, in the request's own thread: sync collectors here, async
        streams on their event loop (one hop per loop per step)."""
        here = asyncio._get_running_loop()
        hops: Dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._requests.get(out.rid)
            if entry is None:
                continue
            # Over here: finished or failed; a sender's request is over once its handoff is out (the core
            # frees it on release_handoff without another output).
            if (
                out.finish_reason is not None
                or out.error is not None
                or (out.handoff is not None and entry.group.handoff == "sender")
            ):
                del self._requests[out.rid]
            loop = entry.group.loop
            if loop is None or loop is here:
                entry.group.feed(entry.index, out, self.abort)
            else:
                hops.setdefault(loop, []).append((entry, out))
        for loop, items in hops.items():
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._feed_all, items)
                except RuntimeError:  # closed meanwhile: its callers are gone
                    pass

    def _feed_all(self, items: list) -> None:
        for entry, out in items:
            entry.group.feed(entry.index, out, self.abort)

    def _on_dead(self, exc: BaseException) -> None:
        """The core is gone: every open request ends with EngineDeadError."""
        err = as_dead_error(exc)
        outputs = [ReqOutput(rid, [], [], None, None, 0, 0, 0, error=err) for rid in list(self._requests)]
        self._dispatch(outputs)
