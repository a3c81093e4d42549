"""Text ⇄ token ids for one model: loading, chat templates, streaming detokenization, stop strings.

Data flow (tokenize once, at the front end: docs/design.md):

    messages ──Tokenizer.apply_chat_template──▶ prompt ids ──▶ router / workers (ids only)
    output ids (streamed) ──IncrementalDetokenizer.step──▶ text deltas ──StopStringMatcher.feed──▶ client
                          (TextStream: both, per output; in the engine, or at the cluster's ingress)

The tokenizer and chat template come from `transformers` (a Hugging Face folder, or the
tokenizer embedded in a GGUF file); nothing here re-implements either.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, NamedTuple, Optional, Sequence

from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.models.source import ModelSource

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(source: ModelSource) -> "Tokenizer":
    """The Tokenizer of `source` (of a GGUF file: of its converted folder, engine.models.gguf_folder),
    cached per folder in this process.

    Never touches the network: files must be local. Raises UnsupportedModelError when
    transformers cannot build a tokenizer from the files.
    """
    from engine.models.gguf_folder import converted_folder

    return _load_cached(converted_folder(source) if source.is_gguf else source.folder)


@functools.lru_cache(maxsize=16)
def _load_cached(folder: str) -> "Tokenizer":
    from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed

    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"cannot load a tokenizer from {folder}: {exc}")
    return Tokenizer(hf, extra_eos_ids=_generation_config_eos_ids(folder))


def _generation_config_eos_ids(folder: str) -> list[int]:
    """`eos_token_id` (int or list) of a HF folder's generation_config.json; [] when absent."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class Tokenizer:
    """A transformers tokenizer plus the facts the engine needs.

    `eos_token_ids` is the union of the tokenizer's declared `eos_token_id` and, for a HF
    folder, generation_config.json's `eos_token_id` (int or list); for a GGUF file, of its
    eos / eot / eom metadata ids. Nothing else is guessed: for the default SmolLM2 model it
    is {2} ('<|im_end|>'); '<|endoftext|>' (id 0) is its unk/pad token, declared eos by
    neither tokenizer nor GGUF, so it is not included (use `stop_token_ids` to add it).

    `decode` never applies `clean_up_tokenization_spaces`: that legacy heuristic rewrites text
    across token boundaries, which would make streamed text differ from the final text.
    """

    def __init__(self, hf: Any, extra_eos_ids: Sequence[int] = ()):
        self.hf = hf
        self.vocab_size: int = len(hf)
        declared = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in [*declared, *extra_eos_ids])
        self._rust_decode = _plain_rust_decode(hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer declares (e.g. BOS).
        InvalidRequestError(param) when `text` is not a string or not valid Unicode (check_text)."""
        self.check_text(text, param)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @staticmethod
    def check_text(text: Any, param: str = "prompt") -> None:
        """InvalidRequestError(param) unless `text` is a string of valid Unicode (a lone surrogate, which
        JSON's \\uD800 escapes can carry, has no UTF-8 form)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}", param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = f"U+{ord(text[exc.start]):04X}"
            raise InvalidRequestError(f"text is not valid Unicode: lone surrogate {bad} at {exc.start}", param=param)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each of `texts` (checked with check_text first), the same ids, in one call: a fast
        tokenizer's Rust backend encodes the batch without holding the GIL (the threads of serving.encoder
        run in parallel there); a slow tokenizer, or a backend set to truncate or pad (which transformers
        turns off per call), encodes the texts one by one."""
        if not texts:
            return []
        rust = getattr(self.hf, "backend_tokenizer", None)
        if rust is not None and rust.truncation is None and rust.padding is None:
            # what transformers' fast tokenizer calls for `encode`, without its per-call Python wrapping
            return [e.ids for e in rust.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        return [list(self.hf.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences decode to U+FFFD. The same text as transformers'
        `decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)`: for a fast tokenizer that
        does not override decoding, that call is its Rust backend's `decode`, called here directly (the
        streaming detokenizer decodes twice per output token, and transformers' per-call argument
        conversion cost more than the decoding itself)."""
        if self._rust_decode is not None:
            return self._rust_decode(ids if isinstance(ids, list) else list(ids), skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def chat_prompt_text(
        self,
        messages: list[dict],
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The model's chat template rendered over `messages` (and `tools`), as text.

        `template_kwargs` go to the template (e.g. `continue_final_message=True`, or
        variables a template reads such as `enable_thinking`). Raises InvalidRequestError
        (param='messages') when the tokenizer has no chat template, the messages are
        malformed, or the template rejects them.
        """
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; send a plain prompt instead", param="messages"
            )
        _check_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of objects", param="tools")
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
        return text

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of `chat_prompt_text(...)`. The rendered text already holds the template's
        special tokens, so it is encoded without adding any (as transformers does)."""
        text = self.chat_prompt_text(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False, param="messages")


def _plain_rust_decode(hf: Any) -> Optional[Any]:
    """The Rust backend's `decode` when `hf.decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)`
    is exactly that call (transformers' fast tokenizer whose class overrides neither `decode` nor `_decode`);
    None otherwise (slow tokenizers, tokenizers with decoding of their own)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its own decode
        return None
    rust = getattr(hf, "_tokenizer", None)
    cls = type(hf)
    if (
        rust is None
        or not isinstance(hf, TokenizersBackend)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
    ):
        return None
    return rust.decode


def _check_messages(messages: Any) -> None:
    """Raise InvalidRequestError unless `messages` is a non-empty list of {'role': str, ...} dicts
    whose 'content' (when present) is a string, a list of parts, or None."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(m).__name__}", param="messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidRequestError(f"messages[{i}] needs a non-empty string 'role'", param="messages")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string, a list of parts, or null", param="messages"
            )


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Contract:
    - `step(ids)` decodes only a small window: the tokens from `prefix_offset` (start of the
      last emitted token run) to the end, and subtracts the text of the already-emitted part
      [prefix_offset, read_offset). Tokens before `prefix_offset` are dropped.
    - While the window's text ends in U+FFFD (a multi-byte character split across tokens)
      nothing is emitted; `flush()` at the finish releases whatever is held.
    - Without `prompt_ids`, the concatenated deltas (steps + flush) equal
      `tokenizer.decode(all_output_ids, skip_special_tokens)`, however the ids are chunked.
    - With `prompt_ids`, the last few prompt tokens are left context, so a first output token's
      leading space survives SentencePiece-style decoders that strip it at the start of a text;
      the deltas then equal the text the output appends to the prompt. For byte-level BPE
      (the default model) that is again exactly `decode(all_output_ids)`.
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Optional[Sequence[int]] = None, skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        context = list(prompt_ids[-self.CONTEXT_TOKENS :]) if prompt_ids else []
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: the output cannot reuse it as context
        # ids[0:read_offset] is context already accounted for; ids[read_offset:] is not yet emitted.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def step(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the newly completed text (may be "")."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return the held-back text (even if it ends in U+FFFD). Stepping may continue after."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # The window slides: the run just emitted becomes the next window's left context.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += delta
        return delta


class StopResult(NamedTuple):
    """One `StopStringMatcher.feed` outcome: text safe to emit, and whether a stop string matched."""

    text: str
    stopped: bool
    matched: Optional[str]


class StopStringMatcher:
    """Finds stop strings in streamed text.

    Contract:
    - `feed(delta)` emits only text that can no longer be the start of a stop string; the
      longest tail that is a proper prefix of some stop string is held back.
    - On a match, output is truncated before the stop string (which is not emitted), `stopped`
      becomes True, and everything after is discarded; later feeds return ("", True, matched).
    - With several stop strings the one that completes first in the text wins (ties: the one
      starting first), so the result does not depend on how the text is chunked.
    - `flush()` at the end returns the held-back text ("" once stopped).
    """

    def __init__(self, stop: Sequence[str] = ()):
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        self.stop = list(dict.fromkeys(stop))
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    def feed(self, delta: str) -> StopResult:
        """Add `delta`; return the emittable text and whether generation must stop."""
        if self.stopped:
            return StopResult("", True, self.matched)
        buf = self._held + delta
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop string)
        for s in self.stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return StopResult(buf[: best[1]], True, best[2])
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return StopResult(buf[: len(buf) - hold], False, None)

    def _partial_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """Release held text at the end of generation (no stop string can complete any more)."""
        held, self._held = self._held, ""
        return held


class TextStream:
    """One output's token ids → the text a client sees, stopping at stop strings.

    The engine's OutputProcessor and the cluster's ingress (which detokenizes for its workers)
    both make text with this, so the text, the stop point and the token count at a stop are the
    same wherever it is made.

    Contract:
    - `feed(token)` returns (text that can be emitted now, the stop string that matched or None).
      A match ends the output at this token: the stop string and everything after it is never
      emitted, and later feeds return ("", the same stop string).
    - `finish()` returns the text held back (an incomplete character, a possible stop-string
      prefix) when the output ends for another reason (EOS, stop token, length, abort).
    """

    def __init__(
        self,
        tokenizer: "Tokenizer",
        prompt_ids: Optional[Sequence[int]] = None,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stop_matcher = StopStringMatcher(stop) if stop else None

    def feed(self, token: int) -> tuple[str, Optional[str]]:
        delta = self.detokenizer.step([token])
        if self.stop_matcher is None:
            return delta, None
        emit, stopped, matched = self.stop_matcher.feed(delta)
        return emit, (matched if stopped else None)

    def finish(self) -> str:
        tail = self.detokenizer.flush()
        if self.stop_matcher is None:
            return tail
        emit, _, _ = self.stop_matcher.feed(tail)
        return emit + self.stop_matcher.flush()
