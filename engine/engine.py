"""Engine: the public API of one replica.

    Engine.generate / generate_stream ─validate, tokenize─▶ inbox ─▶ loop thread:
        Scheduler.step() ─▶ ModelRunner ─▶ OutputProcessor ─▶ Req.on_output ─▶ caller

Requests are validated in the caller's thread (bad input raises a typed error
there and never reaches the loop). The loop thread owns the scheduler and all
KV state; callers talk to it only through the inbox (add, abort, call) and get
results through per-request callbacks, so no lock guards engine state.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Union

from engine.config import EngineConfig
from engine.errors import (EngineAbortedError, EngineDeadError, InvalidConfigError, InvalidRequestError, PromptTooLongError,
                           QueueFullError)
from engine.memory.kv_cache_manager import KVCacheManager
from engine.memory.radix_cache import RadixCache
from engine.models.source import resolve_model
from engine.request import Req, ReqOutput, TokenLogprob
from engine.runner.grammar import GrammarCompiler, GrammarState
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.handoff import KVReservation, PrefillHandoff
from engine.scheduler.scheduler import Scheduler
from engine.tokenizer import TextStream, load_tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
RemotePrefill = Callable[[KVReservation], Awaitable[PrefillHandoff]]
"""Decode side of disaggregation: fills the reserved pages and returns the first token (see generate_stream)."""


def _deliver_to(loop: asyncio.AbstractEventLoop, fn: Callable[[ReqOutput], Any]) -> Callable[[ReqOutput], None]:
    """An on_output callback (run in the engine thread) that hands outputs to `fn` on `loop`; outputs
    for a caller whose event loop has closed (it went away) are dropped."""
    def deliver(out: ReqOutput) -> None:
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, out)
            except RuntimeError:  # closed between the check and the call
                pass
    return deliver


@dataclass
class GenerateOutput:
    """The whole result of one request (one choice when n > 1)."""

    rid: str
    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    matched_stop: Any
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: Optional[List[TokenLogprob]] = None
    prompt_logprobs: Optional[List[TokenLogprob]] = None
    """Logprobs of prompt tokens 1..n-1 (sampling_params.prompt_logprobs set), else None."""


@dataclass
class StreamOutput:
    """What one engine step added to one request (one choice when n > 1)."""

    rid: str
    index: int
    new_token_ids: List[int]
    text: str
    logprobs: Optional[List[TokenLogprob]]
    finish_reason: Optional[str]
    matched_stop: Any
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_logprobs: Optional[List[TokenLogprob]] = None
    """On the first output only, when sampling_params.prompt_logprobs is set."""


@dataclass
class _Accumulator:
    """Collects a request's ReqOutputs for the sync API."""

    index: int
    text: List[str] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[List[TokenLogprob]] = None
    last: Optional[ReqOutput] = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, out: ReqOutput) -> None:
        self.text.append(out.text_delta)
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out
        if out.finish_reason is not None or out.error is not None:
            self.done.set()


class Engine:
    def __init__(self, model: Optional[str] = None, **config: Any):
        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.source = resolve_model(model)
        self.tokenizer = None if self.config.skip_tokenizer_init else load_tokenizer(
            resolve_model(self.config.tokenizer) if self.config.tokenizer else self.source)
        self.runner = ModelRunner(self.config, self.source)
        if self.tokenizer is not None and len(self.tokenizer.hf) > self.runner.vocab_size:
            raise InvalidConfigError(f"the tokenizer has {len(self.tokenizer.hf)} tokens, more than the model's "
                                     f"vocabulary ({self.runner.vocab_size}): give a matching `tokenizer`")
        self._init_tokens()
        self._init_scheduler()
        self._init_loop()

    def _init_tokens(self) -> None:
        """EOS ids and the grammar compiler; without a tokenizer, EOS comes from the model config."""
        if self.tokenizer is not None:
            self.eos_token_ids = self.tokenizer.eos_token_ids
            self.grammar = GrammarCompiler(self.tokenizer.hf, self.runner.vocab_size, self.eos_token_ids)
            return
        eos = getattr(self.runner.model_config, "eos_token_id", None)
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.grammar = None

    def _init_scheduler(self) -> None:
        r = self.runner
        self.tree_cache = RadixCache(r.allocator, page_size=self.config.page_size,
                                     disable=self.config.disable_radix_cache,
                                     enable_events=self.config.enable_cache_events)
        self.kv = KVCacheManager(r.req_to_token_pool, r.allocator, self.tree_cache, self.config.page_size,
                                 self.config.disable_radix_cache)
        self.scheduler = Scheduler(r, self.kv, self.config, r.context_len)
        self.context_len = r.context_len
        self._seed_rng = random.Random(self.config.random_seed)

    def _init_loop(self) -> None:
        self._inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- public API ------------------------------------------------------------------------
    def generate(self, prompt: Union[Prompt, Sequence[Prompt]], sampling_params: Any = None,
                 rid: Optional[str] = None) -> Union[GenerateOutput, List[GenerateOutput]]:
        """Run prompts to completion (blocking).

        `prompt`: a string, a list of token ids, or a list of either (a batch).
        `sampling_params`: a SamplingParams, a dict, or a list of them (one per prompt).
        Returns a GenerateOutput for one prompt with n == 1, else a flat list
        (prompt-major: prompt 0 choices 0..n-1, prompt 1 ...).
        """
        prompts, single = self._as_batch(prompt)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        groups = [self._make_group(p, sp, None if rid is None or not single else rid, None)
                  for p, sp in zip(prompts, params_list)]
        accs: List[_Accumulator] = []
        for reqs in groups:
            for req in reqs:
                accs.append(req.on_output)
        for reqs in groups:
            self._submit(reqs)
        for acc in accs:
            while not acc.done.wait(timeout=0.5):
                self._raise_if_dead()
        outs = [self._to_generate_output(acc) for acc in accs]
        return outs[0] if single and len(outs) == 1 else outs

    async def generate_stream(self, prompt: Prompt, sampling_params: Any = None, rid: Optional[str] = None,
                              remote_prefill: Optional[RemotePrefill] = None) -> AsyncIterator[StreamOutput]:
        """Yield StreamOutputs (one per engine step with news, per choice) until every choice finishes.
        Cancelling the iterator (client disconnect) aborts the request and frees its pages.

        `remote_prefill` (disaggregation, decode side; n must be 1): the prompt is not computed here.
        Once destination pages are reserved, `await remote_prefill(reservation)` must fill them (a
        KVReservation) and return the PrefillHandoff; decoding then continues here. If it raises, the
        request is aborted (pages freed) and the error propagates."""
        loop = asyncio.get_running_loop()
        q: "asyncio.Queue[ReqOutput]" = asyncio.Queue()
        params = SamplingParams.from_any(sampling_params)
        if remote_prefill is not None and params.n != 1:
            raise InvalidRequestError("n > 1 is not supported with a remote prefill", param="n")
        reqs = self._make_group(prompt, params, rid, _deliver_to(loop, q.put_nowait),
                                handoff="import" if remote_prefill is not None else None)
        index = {r.rid: i for i, r in enumerate(reqs)}
        self._submit(reqs)
        pending = len(reqs)
        try:
            while pending:
                out = await q.get()
                if out.error is not None:
                    raise out.error
                if out.handoff is not None:
                    handoff = await remote_prefill(out.handoff)
                    self._inbox.put(("import_done", out.rid, handoff))
                    continue
                pending -= out.finish_reason is not None
                yield StreamOutput(
                    rid=out.rid, index=index[out.rid], new_token_ids=out.new_token_ids, text=out.text_delta,
                    logprobs=out.logprobs if params.logprobs else None,
                    finish_reason=None if out.finish_reason is None else out.finish_reason.value,
                    matched_stop=out.matched_stop, prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens,
                    prompt_logprobs=out.prompt_logprobs)
        finally:
            if pending:
                for r in reqs:
                    self.abort(r.rid)

    async def prefill_for_handoff(self, prompt: Prompt, sampling_params: Any = None,
                                  rid: Optional[str] = None) -> PrefillHandoff:
        """Disaggregation, prefill side: compute the prompt (reusing the radix cache), sample the first
        token, and return a PrefillHandoff naming the pages that hold the prompt's KV. Those pages stay
        held until `release_handoff(rid)` — the caller MUST call it once the transfer is over (done or
        failed). Cancelling the call aborts the request (pages freed)."""
        loop = asyncio.get_running_loop()
        fut: "asyncio.Future[ReqOutput]" = loop.create_future()
        deliver = _deliver_to(loop, lambda out: fut.done() or fut.set_result(out))
        params = SamplingParams.from_any(sampling_params)
        if params.n != 1:
            raise InvalidRequestError("n > 1 is not supported with a remote prefill", param="n")
        (req,) = self._make_group(prompt, params, rid, deliver, handoff="export")
        self._submit([req])
        try:
            out = await fut
        except BaseException:
            self.abort(req.rid)
            raise
        if out.error is not None:
            raise out.error
        if out.handoff is None:  # aborted before the prompt was done
            raise EngineAbortedError(f"request {req.rid} was aborted before its prefill finished")
        return out.handoff

    def release_handoff(self, rid: str) -> None:
        """Prefill side: the KV transfer of `rid` is over; its pages go to the radix cache."""
        self._inbox.put(("release_export", rid))

    def abort(self, rid: str) -> None:
        """Abort a request (all choices of it): waiting or running, its pages are freed."""
        self._inbox.put(("abort", rid))

    def stats(self) -> Dict[str, float]:
        """Running / waiting requests, KV usage, cache hit rate and counters (taken in the loop thread)."""
        return self._call(self.scheduler.stats)

    def drain_cache_events(self) -> list:
        """Radix-cache insert/evict events since the last call (needs enable_cache_events=True)."""
        return self._call(self.tree_cache.drain_events)

    def flush_cache(self) -> None:
        """Drop every unlocked cached prefix (for benchmarks)."""
        self._call(lambda: self.tree_cache.evict(self.tree_cache.evictable_size()))

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- request construction (caller thread) ------------------------------------------------
    @staticmethod
    def _as_batch(prompt) -> tuple:
        if isinstance(prompt, str):
            return [prompt], True
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)], True
        if isinstance(prompt, Sequence) and prompt and all(isinstance(p, (str, list, tuple)) for p in prompt):
            return list(prompt), False
        raise InvalidRequestError("prompt must be a non-empty string, a list of token ids, or a list of those",
                                  param="prompt")

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> List[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise InvalidRequestError(f"got {len(sampling_params)} sampling_params for {n} prompts",
                                          param="sampling_params")
            return [SamplingParams.from_any(sp) for sp in sampling_params]
        params = SamplingParams.from_any(sampling_params)
        return [params] * n

    def _tokenize(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer (skip_tokenizer_init): give token ids",
                                          param="prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.runner.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids must be in [0, {self.runner.vocab_size}), got {bad[:4]}",
                                          param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.context_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the context length is {self.context_len} "
                                     f"(at least one token must be left to generate)", param="prompt")
        if len(ids) + self.config.page_size > self.runner.allocator.size:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the KV pool holds only "
                                     f"{self.runner.allocator.size}", param="prompt")
        return ids

    def _make_group(self, prompt: Prompt, params: SamplingParams, rid: Optional[str],
                    on_output: Optional[Callable[[ReqOutput], None]], handoff: Optional[str] = None) -> List[Req]:
        """The n requests of one prompt. Choices 1..n-1 wait until choice 0 has cached the prompt.
        A constraint (json_schema / regex / ebnf) is compiled here, once per group; each choice
        gets its own GrammarState."""
        params = SamplingParams.from_any(params)
        ids = self._tokenize(prompt)
        if self.tokenizer is None and (params.stop or params.json_schema or params.regex or params.ebnf):
            raise InvalidRequestError("stop strings and structured output need a tokenizer (skip_tokenizer_init)",
                                      param="stop" if params.stop else "json_schema")
        compiled = self.grammar.compile(params) if self.grammar is not None else None
        rid = rid or uuid.uuid4().hex
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        reqs: List[Req] = []
        for i in range(params.n):
            reqs.append(Req(
                rid=rid if params.n == 1 else f"{rid}#{i}", input_ids=ids, params=params, seed=base_seed + i,
                eos_token_ids=self.eos_token_ids,
                on_output=on_output if on_output is not None else _Accumulator(i),
                text=TextStream(self.tokenizer, ids, params.skip_special_tokens, params.stop)
                if self.tokenizer is not None and self.config.detokenize else None,
                wait_for=reqs[0] if i and not self.config.disable_radix_cache else None,
                grammar=GrammarState(compiled) if compiled is not None else None, handoff=handoff))
        return reqs

    def _submit(self, reqs: List[Req]) -> None:
        self._raise_if_dead()
        limit = self.config.max_queued_requests
        if limit is not None and len(self.scheduler.waiting) + len(reqs) > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        for req in reqs:
            self._inbox.put(("add", req))

    def _to_generate_output(self, acc: _Accumulator) -> GenerateOutput:
        last = acc.last
        if last.error is not None:
            raise last.error
        return GenerateOutput(
            rid=last.rid, index=acc.index, text="".join(acc.text), token_ids=acc.token_ids,
            finish_reason=last.finish_reason.value, matched_stop=last.matched_stop,
            prompt_tokens=last.prompt_tokens, cached_tokens=last.cached_tokens,
            completion_tokens=last.completion_tokens, logprobs=acc.logprobs or None,
            prompt_logprobs=acc.prompt_logprobs)

    # ---- loop thread ----------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the loop thread and return its result."""
        self._raise_if_dead()
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout=60)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead!r}") from self._dead

    def _loop(self) -> None:
        try:
            timeout: Optional[float] = None
            while self._drain_inbox(timeout):
                did_work = self.scheduler.step()
                # Idle: sleep on the inbox. Work that cannot start yet (waiting for memory): poll gently.
                timeout = None if not self.scheduler.has_work else (0.0 if did_work else 0.005)
        except BaseException as exc:  # noqa: BLE001 - every pending caller must hear about it
            logger.exception("engine loop failed")
            self._dead = exc
            self._fail_all(exc)
        finally:
            self._dead = self._dead or EngineDeadError("the engine was shut down")
            self._fail_all(self._dead)

    def _drain_inbox(self, timeout: Optional[float]) -> bool:
        """Apply queued messages, waiting up to `timeout` s for the first (None: forever). False on stop."""
        try:
            msg = self._inbox.get_nowait() if timeout == 0.0 else self._inbox.get(timeout=timeout)
        except queue.Empty:
            return True
        while True:
            kind = msg[0]
            if kind == "stop":
                return False
            if kind == "add":
                self.scheduler.add_request(msg[1])
            elif kind == "abort":
                self.scheduler.abort(msg[1])
            elif kind == "import_done":
                self.scheduler.complete_import(msg[1], msg[2])
            elif kind == "release_export":
                self.scheduler.release_export(msg[1])
            elif kind == "call":
                try:
                    msg[2].set_result(msg[1]())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    msg[2].set_exception(exc)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _fail_all(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine loop stopped: {exc!r}")
        for req in self.scheduler._all_reqs():
            if not req.finished:
                req.on_output(ReqOutput(req.rid, [], "", [], None, None, len(req.origin_input_ids),
                                        req.cached_tokens, len(req.output_ids), error=err))
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
