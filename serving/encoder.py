"""BatchEncoder: prompt text → token ids for the routes of one event loop, off that loop and in batches.

The Rust tokenizer takes milliseconds to encode a prompt of a few thousand tokens. Run inline in a route,
the prompts of a burst (a round of multi-turn chats, a wave of chats that share a system prompt) are
encoded one after the other on the event loop, which meanwhile sends no stream its tokens and reads no
new request. So the routes hand their texts to one BatchEncoder per ServingState:

    encode(text) ─▶ future ─┐   pending ──▶ Tokenizer.encode_batch on worker threads ──▶ ids, per text
                            └── resolved with its own ids (a text that is no valid string fails alone, at once)

- One batch is encoded at a time (per add_special_tokens value); the texts asked for meanwhile wait and
  go together in the next one (serving/call_batcher.py). Alone, a text is encoded at once.
- A batch is one `encode_batch` call into the fast tokenizer per worker thread. The Rust tokenizer
  releases the GIL while it encodes a batch, so the event loop runs on, and a batch split over several
  threads is encoded in parallel (`threads`: one per four CPUs, 1 to 4; one on a small machine, where
  the engine needs the cores).
- Ids are the same as `Tokenizer.encode` gives (tests/serving/test_encoder.py).

This is what vLLM's server does with its micro-batching tokenizer; transformers has no asynchronous
batching front of its own. Owned by one ServingState; `encode` runs on its event loop only.
"""

from __future__ import annotations

import asyncio
import functools
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

from engine.tokenizer import Tokenizer
from serving.call_batcher import CallBatcher

MAX_BATCH = 64
"""Texts in one batch at most."""


def default_threads(cpus: Optional[int] = None) -> int:
    """Worker threads of a BatchEncoder: one per four CPUs of this machine, 1 to 4."""
    cpus = os.cpu_count() if cpus is None else cpus
    return max(1, min(4, (cpus or 1) // 4))


def split_even(texts: Sequence[str], parts: int) -> List[Tuple[int, int]]:
    """[start, end) ranges cutting `texts` into at most `parts` consecutive runs, none empty, of about equal
    length in characters (the tokenizer's work): each cut falls at the text boundary nearest its share."""
    parts = max(1, min(parts, len(texts)))
    weights = [len(t) for t in texts]
    if not any(weights):
        weights = [1] * len(texts)
    total = sum(weights)
    bounds: List[Tuple[int, int]] = []
    start = acc = 0
    for i, w in enumerate(weights):
        k = len(bounds) + 1  # the cut being looked for
        if k < parts and i > start:
            target = total * k / parts
            if acc + w > target and target - acc <= acc + w - target:  # the boundary before i is nearer
                bounds.append((start, i))
                start = i
        acc += w
    bounds.append((start, len(texts)))
    return bounds


class BatchEncoder:
    def __init__(self, tokenizer: Tokenizer, threads: Optional[int] = None, max_batch: int = MAX_BATCH):
        self.tokenizer = tokenizer
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="encode")
        self._closer = weakref.finalize(self, self._pool.shutdown, wait=False)  # threads end with the encoder
        self._batchers: Dict[bool, CallBatcher[str]] = {
            special: CallBatcher(
                f"encode (add_special_tokens={special})", functools.partial(self._encode_batch, special), max_batch
            )
            for special in (True, False)
        }
        """One batcher per add_special_tokens: a batch is one encode_batch call, made with one flag."""

    @property
    def batches(self) -> int:
        """Batches encoded so far."""
        return sum(b.calls for b in self._batchers.values())

    @property
    def texts(self) -> int:
        """Texts they carried."""
        return sum(b.items for b in self._batchers.values())

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> List[int]:
        """`Tokenizer.encode(text, add_special_tokens)`; InvalidRequestError(param) for a text that is not a
        string or not valid Unicode, at once."""
        self.tokenizer.check_text(text, param)
        return await self._batchers[add_special_tokens].submit(text)

    def close(self) -> None:
        """Stops the worker threads (after the batch they encode, if any); garbage collection does too."""
        self._closer()

    async def _encode_batch(self, add_special_tokens: bool, texts: List[str]) -> List[List[int]]:
        loop = asyncio.get_running_loop()
        runs = split_even(texts, self.threads)
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self._pool, self.tokenizer.encode_batch, texts[a:b], add_special_tokens)
                for a, b in runs
            )
        )
        return [ids for part in parts for ids in part]
