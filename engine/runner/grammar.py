"""Structured output: JSON schema, Lark, regex and EBNF constraints, compiled and enforced.

Backends: JSON schemas and Lark grammars (which may embed JSON schemas with `%json`) go to
llguidance, which either builds a grammar that matches the schema exactly or refuses it with an
error naming the keyword (engine/runner/json_schema.py adds the few refusals it lacks); regex
and EBNF go to xgrammar. JSON is generated on one line, with one space after "," and ":" and no
other whitespace (json_schema.JSON_COMPACT), unless the schema's top-level "x-guidance" sets
"whitespace_flexible": true. Both backends fill the same
int32 bitmask layout.

Data flow and owners:

    SamplingParams.json_schema / lark / regex / ebnf
      ─GrammarCompiler.compile (Engine, caller's thread; cached per (kind, text))─▶ LlgGrammar | CompiledGrammar
      ─one GrammarState per choice (Req.grammar)─┐
    ModelRunner: build_vocab_mask(grammars) ─────┴─▶ VocabMask (bs, ceil(V / 32)) int32 bitmask
    Sampler: VocabMask.apply_(logits) ─▶ disallowed logits = -inf ─▶ sample / argmax
    OutputProcessor: GrammarState.accept(token) ─▶ is_terminated() ⇒ finish "stop"

A GrammarState lives as long as its Req and has consumed exactly `req.output_ids`.
A retracted request keeps both, so on resume (a prefill over prompt + outputs) nothing
is re-accepted: the next sampled token is the next one the matcher sees.

xgrammar and llguidance are imported lazily (importing xgrammar takes seconds), on the first
grammar request.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence

import torch

from engine.errors import InvalidRequestError
from engine.runner.json_schema import explain, json_schema_grammar
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "lark", "regex", "ebnf")
_WHAT = {"json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regex", "ebnf": "EBNF grammar"}
# Strips xgrammar's C++ log prefix ("[12:00:00] /project/cpp/x.cc:83: ") from error messages.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarKey(NamedTuple):
    """What identifies a compiled grammar: the constraint kind and its exact text."""

    kind: str
    """One of GRAMMAR_KINDS (the SamplingParams field name)."""
    text: str


def grammar_key(params: SamplingParams) -> Optional[GrammarKey]:
    """The (kind, text) constraint of `params`, or None when it has none (validated: at most one)."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind)
        if text is not None:
            return GrammarKey(kind, text)
    return None


class GrammarCompiler:
    """Compiles constraints against one tokenizer; owned by the Engine, shared by its callers.

    Contract:
    - `compile(params)` runs in the caller's thread and either returns a CompiledGrammar
      (None without a constraint) or raises InvalidRequestError with `param` naming the
      field; the engine loop never sees an invalid grammar.
    - Repeated constraints are cheap: an LRU of `cache_size` CompiledGrammars keyed by
      GrammarKey answers them without calling xgrammar (a dict lookup under a lock).
      xgrammar's own compiler cache sits behind it. Two threads compiling the same new
      key at once may both call xgrammar; the first result is kept.
    - The bitmask covers `vocab_size` (the model's logits width), which may exceed the
      tokenizer's vocabulary; xgrammar never allows the extra ids.
    - Thread-safe.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
        max_threads: Optional[int] = None,
    ):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = cache_size
        self.max_threads = max_threads or min(8, os.cpu_count() or 1)
        self._cache: "OrderedDict[GrammarKey, Any]" = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._llg: Any = None
        self._llg_problem: Optional[str] = None
        """Why llguidance's table of this tokenizer was refused (token_bytes_mismatch), once found."""
        self._xgr_problem: Optional[str] = None
        """Why xgrammar could not read this tokenizer (its TokenizerInfo failed), once found."""
        self.stats = dict(hits=0, compiles=0)

    def compile(self, params: SamplingParams) -> Optional[Any]:
        """The compiled constraint of `params` (LlgGrammar for json_schema / lark, an
        xgrammar.CompiledGrammar for regex / ebnf; None when it has none).

        Raises InvalidRequestError(param=kind) when the schema, regex or grammar is invalid,
        or (JSON schema) uses a feature that would not be enforced exactly; the message names it.
        """
        key = grammar_key(params)
        if key is None:
            return None
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.stats["hits"] += 1
                return compiled
        compiled = self._compile(key)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.stats["compiles"] += 1
        return compiled

    def _xgrammar_compiler(self, kind: str) -> Any:
        with self._lock:
            if self._compiler is None and self._xgr_problem is None:
                import xgrammar as xgr  # noqa: PLC0415  (slow import: only once a grammar is used)

                try:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                    )
                    self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
                except Exception as exc:  # noqa: BLE001 - reported to the caller as unsupported
                    # Kept, as llguidance's: the tokenizer does not change, so retrying would fail the same way.
                    self._xgr_problem = str(exc) or repr(exc)
                    logger.warning(
                        "regex and EBNF constraints are refused: xgrammar cannot read the tokenizer: %s (%s)",
                        self._xgr_problem,
                        _library_versions("xgrammar"),
                    )
            if self._xgr_problem is not None:
                raise InvalidRequestError(
                    f"structured output is not supported for this tokenizer: {self._xgr_problem}", param=kind
                )
            return self._compiler

    def _llg_tokenizer(self, kind: str) -> Any:
        with self._lock:
            if self._llg is None and self._llg_problem is None:
                import llguidance.hf  # noqa: PLC0415

                try:
                    llg = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids or None
                    )
                    problem = token_bytes_mismatch(llg.decode_bytes, self.hf_tokenizer)
                except Exception as exc:  # noqa: BLE001 - reported to the caller as unsupported
                    problem = str(exc)
                if problem:
                    # Kept: the tokenizer does not change, so later requests are refused without rebuilding the table.
                    self._llg_problem = problem
                    logger.warning(
                        "JSON schemas and Lark grammars are refused: %s (%s)", problem, _library_versions("llguidance")
                    )
                else:
                    self._llg = llg
            if self._llg_problem is not None:
                raise InvalidRequestError(
                    f"structured output is not supported for this tokenizer: {self._llg_problem}", param=kind
                )
            return self._llg

    def _compile(self, key: GrammarKey) -> Any:
        if key.kind in ("json_schema", "lark"):
            return self._compile_llg(key)
        compiler = self._xgrammar_compiler(key.kind)
        try:
            if key.kind == "regex":
                return compiler.compile_regex(key.text)
            return compiler.compile_grammar(key.text)
        except (RuntimeError, ValueError, TypeError) as exc:
            msg = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
            raise InvalidRequestError(f"invalid or unsupported {_WHAT[key.kind]}: {msg}", param=key.kind) from exc

    def _compile_llg(self, key: GrammarKey) -> "LlgGrammar":
        import llguidance  # noqa: PLC0415

        tokenizer = self._llg_tokenizer(key.kind)
        if key.kind == "json_schema":
            try:
                schema = json.loads(key.text)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequestError(f"json_schema is not valid JSON: {exc}", param="json_schema") from exc
            grammar = json_schema_grammar(schema)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(key.text)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        matcher = None if error else llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher is not None and matcher.is_error():
            error = matcher.get_error()
        if error:
            what = "unsupported JSON schema" if key.kind == "json_schema" else "invalid or unsupported Lark grammar"
            raise InvalidRequestError(f"{what}: {explain(error)}", param=key.kind)
        return LlgGrammar(matcher, frozenset(self.stop_token_ids))


# Text whose tokens cover what a grammar's byte table must get right: spaces before words and
# punctuation, digits, quotes, a newline and non-ASCII letters.
_BYTE_PROBE = 'Ab, "c d": [1, 23.5], {x_y}\n  é ü'


def token_bytes_mismatch(decode_bytes: Any, hf_tokenizer: Any) -> Optional[str]:
    """None when `decode_bytes` (token ids -> bytes: the grammar backend's view of the vocabulary) gives back
    the UTF-8 of a probe text that `hf_tokenizer` encoded (after the one leading space of a SentencePiece dummy
    prefix, if any); else what differs.

    llguidance builds its byte table from the tokenizer's internals, and a transformers version that
    exposes them differently yields a table that misreads tokens (a byte-level "Ġ" kept as two bytes
    instead of a space): its masks would then allow what its matcher refuses. Checked once per tokenizer,
    so such a pairing refuses structured output with a clear error instead of failing requests."""
    ids = hf_tokenizer.encode(_BYTE_PROBE, add_special_tokens=False)
    got = bytes(decode_bytes(ids))
    want = _BYTE_PROBE.encode()
    # SentencePiece tokenizers with a dummy prefix (Llama 2, Mistral) start the text with "▁": one space.
    if got in (want, b" " + want):
        return None
    return f"the grammar backend reads {want!r} as {got!r} (its byte table disagrees with the tokenizer)"


def _library_versions(backend: str) -> str:
    """The installed versions that decide how a grammar backend (llguidance, xgrammar) reads the tokenizer, for
    the operator's log: a transformers other than the one pyproject.toml pins can load a tokenizer whose
    internals the backend reads differently."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    found = []
    for name in ("transformers", "tokenizers", backend):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found) + "; pyproject.toml pins the versions this check passes with"


@dataclass(frozen=True)
class LlgGrammar:
    """A compiled llguidance grammar: a matcher at its start, copied for each request (never advanced)."""

    template: Any
    """llguidance.LLMatcher in its initial state."""
    stop_token_ids: frozenset
    """The tokens that end a completed grammar (its EOS)."""


class GrammarState:
    """One request's position in its grammar (an xgrammar.GrammarMatcher or an llguidance.LLMatcher).

    Used only by the engine loop thread. It has consumed exactly the request's output
    tokens; it ends terminated once it accepts a stop token (EOS) after a complete match.
    """

    def __init__(self, compiled: Any):
        if isinstance(compiled, LlgGrammar):
            self._llg = compiled.template.deep_copy()
            self._stops = compiled.stop_token_ids
            self._matcher = None
            self._done = False
        else:
            import xgrammar as xgr  # noqa: PLC0415

            self._llg = None
            self._matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ((bs, ceil(V / 32)) int32, cpu)."""
        if self._llg is not None:
            import llguidance.torch  # noqa: PLC0415

            llguidance.torch.fill_next_token_bitmask(self._llg, bitmask, row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar forbids it."""
        if self._llg is not None:
            ok = bool(self._llg.consume_token(int(token_id))) and not self._llg.is_error()
            # llguidance stops as soon as nothing but EOS may follow; the request ends on the EOS itself.
            self._done = ok and int(token_id) in self._stops and self._llg.is_stopped()
            return ok
        return bool(self._matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token has been accepted."""
        if self._llg is not None:
            return self._done
        return bool(self._matcher.is_terminated())


@dataclass
class VocabMask:
    """Allowed-token bitmask of one batch's grammar rows."""

    bitmask: torch.Tensor
    """(bs, ceil(V / 32)) int32, on the logits' device; bit v of row i set = token v allowed."""
    rows: List[int]
    """Batch rows that have a grammar; the other rows are left untouched."""

    def apply_(self, logits: torch.Tensor) -> None:
        """Set disallowed logits of the grammar rows to -inf, in place ((bs, V) float32)."""
        import xgrammar as xgr  # noqa: PLC0415

        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[1], indices=self.rows)


def build_vocab_mask(
    grammars: Sequence[Optional[GrammarState]], vocab_size: int, device: torch.device
) -> Optional[VocabMask]:
    """The VocabMask of a batch (row i = grammars[i]), or None when no row has a grammar.

    Filled on the CPU row by row (xgrammar's matchers are host objects; a fill costs a few µs
    from its per-state mask cache, less than xgrammar.BatchGrammarMatcher's thread hand-off),
    then copied to `device` once for the whole batch.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    import xgrammar as xgr  # noqa: PLC0415

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    if device.type == "cuda":
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        bitmask = bitmask.to(device)
    return VocabMask(bitmask=bitmask, rows=rows)
