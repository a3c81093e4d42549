"""From token-id prompts to a stream of outputs, and from that stream to HTTP.

    prompts (ids) ──GenerationStream.start──▶ one backend stream per prompt, each primed with its
        first output (so a rejected request is a 400/503 before any byte is sent)
    ──iterate()──▶ (prompt index, StreamOutput) merged over prompts
    ──SSEResponse──▶ `data: {json}\\n\\n` … `data: [DONE]\\n\\n`

Ownership: a GenerationStream owns its backend streams and its request's Lifetime (deadline, drain:
every wait for an output is bounded by it). `close()` (called whatever ends the
response: finish, error, client disconnect) cancels them and aborts their rids, so the engine
frees their pages. `SSEResponse` watches for the client's disconnect itself (Starlette does not
on ASGI spec >= 2.4), and `cancel_on_disconnect` does the same for non-streamed responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse

from engine.sampling_params import SamplingParams
from serving.backend import ServingBackend
from serving.errors import APIError, error_body, to_api_error
from serving.lifetime import Lifetime
from serving.metrics import RequestTimer


class GenerationStream:
    """The backend streams of one HTTP request (one per prompt, each with params.n choices)."""

    def __init__(
        self,
        backend: ServingBackend,
        rids: List[str],
        iters: List[AsyncIterator[Any]],
        firsts: List[Any],
        timer: Optional[RequestTimer],
        lifetime: Optional[Lifetime] = None,
    ):
        self.backend, self.rids, self.iters, self.firsts, self.timer = backend, rids, iters, firsts, timer
        self.lifetime = lifetime
        self.n = 1
        self._tasks: List[asyncio.Task] = []
        self._closed = False

    @classmethod
    async def start(
        cls,
        backend: ServingBackend,
        prompts: List[List[int]],
        params: SamplingParams,
        base_rid: str,
        timer: Optional[RequestTimer] = None,
        lifetime: Optional[Lifetime] = None,
    ) -> "GenerationStream":
        """Submit every prompt and wait for each one's first output; raise the first rejection (or the
        lifetime's error when its deadline passes first). The stream owns `lifetime` and ends it on close."""
        rids = [base_rid if len(prompts) == 1 else f"{base_rid}-{i}" for i in range(len(prompts))]
        iters = [backend.generate_stream(ids, params, rid).__aiter__() for ids, rid in zip(prompts, rids)]
        stream = cls(backend, rids, iters, [], timer, lifetime)
        stream.n = params.n
        try:
            results = await stream._bounded(asyncio.gather(*(it.__anext__() for it in iters), return_exceptions=True))
        except BaseException:
            await stream.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await stream.close()
            raise errors[0]
        stream.firsts = list(results)
        return stream

    def _bounded(self, work: Awaitable[Any]) -> Awaitable[Any]:
        return work if self.lifetime is None else self.lifetime.bounded(work)

    async def iterate(self) -> AsyncIterator[Tuple[int, Any]]:
        """(prompt index, StreamOutput) until every choice of every prompt finished."""
        if len(self.iters) == 1:
            yield self._seen(0, self.firsts[0])
            it = self.iters[0]
            while True:
                try:
                    out = await self._bounded(it.__anext__())
                except StopAsyncIteration:
                    return
                yield self._seen(0, out)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                await queue.put((i, self.firsts[i]))
                async for out in self.iters[i]:
                    await queue.put((i, out))
                await queue.put((i, None))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, exc))

        self._tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.iters))]
        pending = len(self.iters)
        while pending:
            i, out = await self._bounded(queue.get())
            if out is None:
                pending -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield self._seen(i, out)

    def _seen(self, i: int, out: Any) -> Tuple[int, Any]:
        if self.timer is not None:
            self.timer.on_output(out, prompt_key=(i, out.index))
        return i, out

    async def close(self) -> None:
        """Stop every backend stream and abort its request (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for it in self.iters:
            with contextlib.suppress(BaseException):
                await it.aclose()
        for rid in self.rids:
            self.backend.abort(rid)
        if self.timer is not None:
            self.timer.finish()
        if self.lifetime is not None:
            self.lifetime.end()


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: List[str] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[Any] = field(default_factory=list)
    prompt_logprobs: Optional[List[Any]] = None
    finish_reason: Optional[str] = None
    matched_stop: Any = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: Any) -> None:
        self.text.append(out.text)
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or []
        if getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.matched_stop = out.matched_stop
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens

    @property
    def full_text(self) -> str:
        return "".join(self.text)


async def collect(stream: GenerationStream, num_prompts: int, n: int) -> List[ChoiceState]:
    """Run a stream to the end; choices in prompt-major order (prompt i, choice j → i * n + j)."""
    states = [ChoiceState() for _ in range(num_prompts * n)]
    try:
        async for i, out in stream.iterate():
            states[i * n + out.index].add(out)
    finally:
        await stream.close()
    return states


def sse(data: Any) -> str:
    """One server-sent event carrying `data` as compact JSON (or a literal string like [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


_SLOT = "\u0000text\u0000"
"""Stands for the text in a chunk template (no generated text is compared with it: it is only split on)."""


class TextEvents:
    """The SSE events of one stream's plain text chunks: `sse(make(index, text))` for a `make` whose chunk
    differs from one text to the next only in that text. The chunk is encoded once per choice index with a
    placeholder, and each event is that encoding with the text's own JSON string in its place: the same
    characters as `sse` gives (`encode_basestring` is what json.dumps(ensure_ascii=False) writes for a
    string), without building and encoding the whole chunk for every token."""

    def __init__(self, make: Callable[[int, str], Any]):
        self._make = make
        self._parts: Dict[int, Optional[Tuple[str, str]]] = {}

    def __call__(self, index: int, text: str) -> str:
        if index not in self._parts:
            slot = encode_basestring(_SLOT)
            head, found, tail = sse(self._make(index, _SLOT)).partition(slot)
            # The placeholder elsewhere in the chunk too (a model name holding it): encode every event whole.
            self._parts[index] = (head, tail) if found and slot not in head + tail else None
        parts = self._parts[index]
        if parts is None:
            return sse(self._make(index, text))
        return parts[0] + encode_basestring(text) + parts[1]


def stream_response(stream: GenerationStream, events: AsyncIterator[str]) -> "SSEResponse":
    """The SSE response of `stream`'s `events` (sse_events). It closes `stream` whatever happens, also when
    the client left before the body was ever iterated (closing a never-started generator skips its body)."""
    return SSEResponse(sse_events(stream, events), on_close=stream.close)


async def sse_events(stream: GenerationStream, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events` then `data: [DONE]`; an error mid-stream becomes an error event. Always closes `stream`
    once iterated (stream_response also closes it when the body never is)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        err = to_api_error(exc)
        yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        await stream.close()
    yield sse("[DONE]")


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops (and closes its iterator) when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Optional[Any] = None):
        super().__init__(
            content, media_type=self.media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
            if self._on_close is not None:
                await self._on_close()


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (then its stream aborts)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (the server's own disconnect handling): so is the work
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise APIError(499, "the client closed the request", None, "client_closed")
    return task.result()
