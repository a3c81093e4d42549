"""Chat completion chunks (SSE) and chat logprobs.

Per choice: a first chunk with the role, then content deltas, then a chunk with the
finish_reason; with `stream_options.include_usage`, a last chunk with `choices: []` and usage.
Tool calls: a forced call (tool_choice "required" / named) is held until the choice finishes,
then sent as OpenAI tool-call deltas (id, type and name first, then the arguments), with
finish_reason "tool_calls"; cut by max_tokens, it sends nothing but finish_reason "length".
With "auto", text is held only while it may still become a call
(it starts like JSON or <tool_call>); once it cannot, it streams as content.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional

from serving import tool_calls as tc
from serving.protocol import TokenLogprobEntry, TopLogprob
from serving.state import ServingState, UsageTracker
from serving.streams import GenerationStream, TextEvents, sse

if TYPE_CHECKING:
    from serving.chat import ChatPlan
    from serving.protocol import ChatCompletionRequest


def logprob_entries(st: ServingState, logprobs: List[Any]) -> List[TokenLogprobEntry]:
    """Chat-format logprobs of engine TokenLogprobs."""
    entries = []
    for lp in logprobs:
        tok = st.token_str(lp.token_id)
        tops = [
            TopLogprob(token=st.token_str(t), logprob=v, bytes=list(st.token_str(t).encode()))
            for t, v in lp.top_logprobs
        ]
        entries.append(TokenLogprobEntry(token=tok, logprob=lp.logprob, bytes=list(tok.encode()), top_logprobs=tops))
    return entries


class _Choice:
    """Streaming state of one choice."""

    def __init__(self, tool_mode: Optional[str]):
        self.started = False
        self.holding = tool_mode is not None
        self.held: List[str] = []
        self.held_logprobs: List[Any] = []


async def chat_events(
    st: ServingState, body: "ChatCompletionRequest", plan: "ChatPlan", rid: str, stream: GenerationStream
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage = UsageTracker()
    choices: Dict[int, _Choice] = {}

    def chunk_data(index: int, delta: dict, logprobs: Optional[List[Any]] = None, finish: Optional[str] = None) -> dict:
        lps = None
        if body.logprobs and logprobs is not None:
            lps = {"content": [e.model_dump() for e in logprob_entries(st, logprobs)], "refusal": None}
        data: Dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": st.model_name,
            "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}],
        }
        if include_usage:
            data["usage"] = None
        return data

    def chunk(index: int, delta: dict, logprobs: Optional[List[Any]] = None, finish: Optional[str] = None) -> str:
        if finish is None and len(delta) == 1 and "content" in delta and not (body.logprobs and logprobs is not None):
            return plain(index, delta["content"])
        return sse(chunk_data(index, delta, logprobs, finish))

    plain = TextEvents(lambda index, text: chunk_data(index, {"content": text}))

    async for _, out in stream.iterate():
        usage.add(0, out)
        c = choices.setdefault(out.index, _Choice(plan.tool_mode))
        if not c.started:
            c.started = True
            yield chunk(out.index, {"role": "assistant", "content": ""})
        if c.holding:
            c.held.append(out.text)
            c.held_logprobs += out.logprobs or []
            if plan.tool_mode == "auto" and not tc.may_become_tool_call("".join(c.held)):
                c.holding = False
                yield chunk(out.index, {"content": "".join(c.held)}, c.held_logprobs)
                c.held, c.held_logprobs = [], []
        elif out.text or out.logprobs or out.new_token_ids:  # like vLLM: a chunk per step with tokens
            yield chunk(out.index, {"content": out.text}, out.logprobs or [])
        if out.finish_reason is None:
            continue
        finish = out.finish_reason
        if c.holding:
            text = "".join(c.held)
            calls = plan.parse_calls(text)
            if calls:
                finish = "tool_calls"
                for j, call in enumerate(calls):
                    yield chunk(
                        out.index,
                        {
                            "tool_calls": [
                                {
                                    "index": j,
                                    "id": call.id,
                                    "type": "function",
                                    "function": {"name": call.function.name, "arguments": ""},
                                }
                            ]
                        },
                    )
                    yield chunk(
                        out.index, {"tool_calls": [{"index": j, "function": {"arguments": call.function.arguments}}]}
                    )
            elif (text or c.held_logprobs) and not plan.is_cut_call(text):
                yield chunk(out.index, {"content": text}, c.held_logprobs)
        yield chunk(out.index, {}, None, finish)
    if include_usage:
        yield sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": st.model_name,
                "choices": [],
                "usage": usage.usage().model_dump(),
            }
        )
