"""EngineCore: the scheduler loop of one replica and everything it owns.

    inbox (AddRequest(s), AbortRequest, CompleteReceive, ReleaseSent, CoreCall)
      ─▶ handle ─▶ Scheduler.step ─▶ ModelRunner ─▶ OutputProcessor ─▶ Req.on_output = collect
      ─▶ one StepOutputs per step (every request's news) ─▶ outbox

It runs where the device is: in a thread of the Engine's process, or alone in a process of its own
(engine.core.process), where it does nothing but schedule and run the model — no HTTP, no text, no
per-request messages. It owns the ModelRunner, the KV pools, the RadixCache, the Scheduler and the
grammar compiler; nothing else touches them, so no lock guards them.

Grammars (structured output) are compiled on a worker thread: a group waits in `_compiling` until
its grammar is ready (or fails its choices with the compile error), so a slow schema never stalls
the running batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from engine.config import EngineConfig
from engine.core.messages import (
    AbortRequest,
    AddRequest,
    AddRequests,
    CallResult,
    CompleteReceive,
    CoreCall,
    CoreInfo,
    ReleaseSent,
    StepOutputs,
)
from engine.core import warmup
from engine.core.stats_log import StatsLog
from engine.errors import InvalidConfigError, InvalidRequestError, as_dead_error
from engine.memory.kv_cache_manager import KVCacheManager
from engine.memory.radix_cache import RadixCache
from engine.models.source import ModelSource
from engine.outputs import EngineStats, FinishReason, ReqOutput
from engine.profiling import ProfileError, StepProfiler
from engine.request import Req
from engine.runner.grammar import GrammarCompiler, GrammarState, grammar_key
from engine.runner.model_runner import ModelRunner
from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.005
"""Inbox wait while there is work that cannot start yet (waiting for memory, a grammar compiling)."""
RANK_POLL_S = 1.0
"""Longest idle wait of a tensor-parallel rank 0 between two checks that every other rank still lives."""


@dataclass
class _Compiling:
    """A group whose grammar is being compiled."""

    reqs: List[Req]
    future: "Future[Any]"


class EngineCore:
    """Owns one replica's model, KV memory and scheduler; driven by messages (see the module docstring)."""

    def __init__(self, config: EngineConfig, source: ModelSource, tokenizer: Any = None):
        """`tokenizer`: engine.tokenizer.Tokenizer for grammars (None: structured output is refused)."""
        self.config = config
        self.runner = ModelRunner(config, source)
        try:
            if tokenizer is not None and len(tokenizer.hf) > self.runner.vocab_size:
                raise InvalidConfigError(
                    f"the tokenizer has {len(tokenizer.hf)} tokens, more than the model's "
                    f"vocabulary ({self.runner.vocab_size}): give a matching `tokenizer`"
                )
            self._init_tokens(tokenizer)
            self._init_scheduler()
            if warmup.wanted(config, self.runner.device):
                logger.info("warmed up in %.1f s", warmup.warm_up(self))
        except BaseException:
            self.runner.close()  # tensor parallelism: the other ranks must not outlive a failed start
            raise
        self.profiler = StepProfiler(config.profile_dir, self.runner.device) if config.profile_dir else None
        self._outputs: List[ReqOutput] = []
        self._compiling: List[_Compiling] = []
        self._compile_pool: Optional[ThreadPoolExecutor] = None

    def _init_tokens(self, tokenizer: Any) -> None:
        """EOS ids and the grammar compiler; without a tokenizer, EOS comes from the model config."""
        if tokenizer is not None:
            self.eos_token_ids = tokenizer.eos_token_ids
            self.grammar = GrammarCompiler(tokenizer.hf, self.runner.vocab_size, self.eos_token_ids)
            return
        eos = getattr(self.runner.model_config, "eos_token_id", None)
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.grammar = None

    def _init_scheduler(self) -> None:
        r, c = self.runner, self.config
        self.tree_cache = RadixCache(
            r.allocator, page_size=c.page_size, disable=c.disable_radix_cache, enable_events=c.enable_cache_events
        )
        self.kv = KVCacheManager(r.req_to_token_pool, r.allocator, self.tree_cache, c.page_size, c.disable_radix_cache)
        self.scheduler = Scheduler(r, self.kv, c, r.context_len)

    def info(self) -> CoreInfo:
        r = self.runner
        return CoreInfo(
            vocab_size=r.vocab_size,
            context_len=r.context_len,
            kv_capacity_tokens=r.allocator.size,
            page_size=self.config.page_size,
            eos_token_ids=frozenset(self.eos_token_ids),
            device=str(r.device),
            attention_backend=r.attn_backend_name,
            cuda_graphs=r.graph_runner is not None,
            pid=os.getpid(),
        )

    # ---- the loop ------------------------------------------------------------------------
    def run(self, receive: Callable[[Optional[float]], List[Any]], send: Callable[[Any], None]) -> None:
        """Serve messages until `receive` returns None (shut down).

        `receive(timeout)` returns the messages waiting (waiting up to `timeout` s for the first; None:
        forever), or None to stop. `send(obj)` delivers a StepOutputs or CallResult to the front end.
        Raises what the model raised, or TensorParallelError once another rank has died (checked before
        each round of messages, at least every RANK_POLL_S while idle); the caller then fails every request
        (fail_all) and the engine is dead."""
        timeout: Optional[float] = None
        idle_timeout = RANK_POLL_S if self.runner.watches_ranks else None
        interval = self.config.log_stats_interval_s
        stats_log = StatsLog(interval) if interval > 0 else None
        while True:
            messages = receive(timeout)
            if messages is None:
                return
            start = time.perf_counter()
            self.runner.check_ranks()
            for msg in messages:
                result = self.handle(msg)
                if result is not None:
                    send(result)
            did_work = self.step()
            if self._outputs:
                send(StepOutputs(self.take_outputs()))
            if did_work and self.profiler is not None:
                self.profiler.after_step()
            if stats_log is not None:
                if did_work:
                    stats_log.iteration(time.perf_counter() - start)
                stats_log.maybe_log(self.call_stats)
            # Idle: sleep on the inbox. Work that cannot start yet (memory, grammars): poll gently.
            timeout = idle_timeout if not self.has_work else (0.0 if did_work else IDLE_POLL_S)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling)

    def step(self) -> bool:
        """Admit compiled groups, then run one scheduler step. False when there was nothing to do."""
        admitted = bool(self._compiling) and self._admit_compiled()
        return self.scheduler.step() or admitted

    def _collect(self, out: ReqOutput) -> None:
        """Every Req's on_output: the step's outputs go out together."""
        self._outputs.append(out)

    def take_outputs(self) -> List[ReqOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # ---- messages ------------------------------------------------------------------------
    def handle(self, msg: Any) -> Optional[CallResult]:
        """Apply one message; a CoreCall returns its CallResult."""
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AddRequests):
            for add in msg.requests:
                self._add(add)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg.rid)
            self.scheduler.process_aborts()  # now, not at the next step: stats taken next see it gone
            for pending in self._compiling:
                for req in pending.reqs:
                    if req.rid == msg.rid or req.rid.startswith(msg.rid + "#"):
                        req.to_abort = True
        elif isinstance(msg, CompleteReceive):
            self.scheduler.complete_receive(msg.rid, msg.handoff)
        elif isinstance(msg, ReleaseSent):
            self.scheduler.release_sent(msg.rid)
        elif isinstance(msg, CoreCall):
            try:
                return CallResult(msg.call_id, getattr(self, "call_" + msg.method)(*msg.args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                return CallResult(msg.call_id, error=exc)
        else:
            raise TypeError(f"unknown engine message {msg!r}")
        return None

    def _add(self, msg: AddRequest) -> None:
        reqs = self._make_group(msg)
        if grammar_key(msg.params) is None:
            self._enqueue(reqs)
            return
        if self.grammar is None:
            self._fail(
                reqs,
                InvalidRequestError("structured output needs a tokenizer (skip_tokenizer_init)", param="json_schema"),
            )
            return
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling.append(_Compiling(reqs, self._compile_pool.submit(self.grammar.compile, msg.params)))

    def _make_group(self, msg: AddRequest) -> List[Req]:
        """The n requests of one prompt. Choices 1..n-1 wait until choice 0 has cached the prompt."""
        n, reqs = msg.params.n, []
        for i in range(n):
            reqs.append(
                Req(
                    rid=msg.rid if n == 1 else f"{msg.rid}#{i}",
                    input_ids=msg.input_ids,
                    params=msg.params,
                    seed=msg.seed + i,
                    eos_token_ids=self.eos_token_ids,
                    on_output=self._collect,
                    wait_for=reqs[0] if i and not self.config.disable_radix_cache else None,
                    handoff=msg.handoff,
                )
            )
        return reqs

    def _enqueue(self, reqs: List[Req]) -> None:
        for req in reqs:
            self.scheduler.add_request(req)

    def _admit_compiled(self) -> bool:
        """Move groups whose grammar is compiled into the scheduler (or fail them). True if any moved."""
        done = [p for p in self._compiling if p.future.done()]
        for pending in done:
            self._compiling.remove(pending)
            reqs = pending.reqs
            if any(r.to_abort for r in reqs):
                self._fail(reqs, None)
                continue
            try:
                compiled = pending.future.result()
            except Exception as exc:  # noqa: BLE001 - an invalid grammar fails its request only
                self._fail(reqs, exc)
                continue
            for req in reqs:
                req.grammar = GrammarState(compiled)
            self._enqueue(reqs)
        return bool(done)

    def _fail(self, reqs: List[Req], error: Optional[BaseException]) -> None:
        """End requests that never reached the scheduler: with `error`, or as aborted (None)."""
        for req in reqs:
            if error is None:
                req.finish_reason = FinishReason.ABORT
            self._outputs.append(
                ReqOutput(req.rid, [], [], req.finish_reason, None, len(req.origin_input_ids), 0, 0, error=error)
            )

    # ---- calls (CoreCall.method → call_<method>) ------------------------------------------
    def call_stats(self) -> EngineStats:
        """Running / waiting requests, KV usage, cache hit rate and counters."""
        stats = self.scheduler.stats()
        return dataclasses.replace(stats, waiting=stats.waiting + sum(len(p.reqs) for p in self._compiling))

    def call_drain_cache_events(self) -> list:
        """Radix-cache insert/evict events since the last call (needs enable_cache_events=True)."""
        return self.tree_cache.drain_events()

    def call_start_profile(self, num_steps: Optional[int] = None) -> str:
        """Start a torch profiler trace of the loop (stopping by itself after `num_steps` steps with work, if
        given); returns the trace's path. ProfileError when profiling is off or a profile already records."""
        return self._profiler().start(num_steps)

    def call_stop_profile(self) -> str:
        """Stop the profile and write its trace; returns the path."""
        return self._profiler().stop()

    def _profiler(self) -> StepProfiler:
        if self.profiler is None:
            raise ProfileError("profiling is off: set profile_dir (servers: --profile-dir)")
        return self.profiler

    def call_export_kv_pool(self) -> Any:
        """The KV pool's KVPoolHandle (engine.memory.kv_pool), with which the front end's process maps it."""
        return self.runner.kv_pool.export()

    def call_flush_cache(self) -> None:
        """Drop every unlocked cached prefix (for benchmarks)."""
        self.tree_cache.evict(self.tree_cache.evictable_size())

    # ---- failure and shutdown -------------------------------------------------------------
    def fail_all(self, exc: BaseException) -> List[ReqOutput]:
        """Every unfinished request ends with an EngineDeadError; returns their outputs (not sent)."""
        err = as_dead_error(exc)
        reqs = self.scheduler.drop_all() + [r for p in self._compiling for r in p.reqs]
        self._compiling.clear()
        self._outputs.clear()
        for req in reqs:
            if not req.finished:
                self._outputs.append(
                    ReqOutput(
                        req.rid,
                        [],
                        [],
                        None,
                        None,
                        len(req.origin_input_ids),
                        req.cached_tokens,
                        len(req.output_ids),
                        error=err,
                    )
                )
        return self.take_outputs()

    def close(self) -> None:
        """Stop the grammar workers and, with tensor parallelism, the other ranks."""
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
