"""Other APIs on the chat path: the Responses API and Anthropic Messages translate their requests into a
ChatCompletionRequest and their answers out of chat-level deltas, so the chat template, tool prompting,
call constraint and parsing (serving/chat.py, serving/tool_calls.py), validation and usage are the chat
route's own.

    ChatCompletionRequest ──prepare_chat──▶ (ChatPlan, SamplingParams) ──ServingState.start_stream──▶
    GenerationStream ──chat_deltas──▶ Delta(text) ... Delta(calls) Delta(finish, token counts)

Streaming text under tools: with tool_choice "auto" text is held only while it may still become a call,
with a forced choice until the end (as the chat route streams, serving/chat_stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from engine.sampling_params import SamplingParams
from serving import tool_calls as tc
from serving.chat import ChatPlan, plan_chat
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, ToolCall
from serving.state import ServingState
from serving.streams import GenerationStream


async def prepare_chat(
    st: ServingState, body: ChatCompletionRequest, rename: Optional[Dict[str, str]] = None
) -> Tuple[ChatPlan, SamplingParams]:
    """The chat plan and sampling parameters of `body` (one choice); a 400 names the caller's parameter:
    `rename` maps the chat route's names ("messages", "max_tokens", ...) to the calling API's."""
    rename = rename or {}
    try:
        plan = await plan_chat(st, body)
        st.check_ids(plan.prompt_ids, "messages")
        max_tokens = st.check_context(len(plan.prompt_ids), body.max_completion_tokens, "messages")
        params = st.sampling_params(body, max_tokens, json_schema=plan.json_schema)
    except APIError as exc:
        if exc.param in rename:
            exc.param = rename[exc.param]
        raise
    return plan, params


@dataclass
class Delta:
    """One step of an answer: text to append, tool calls (all at once, at the end), or the finish."""

    text: str = ""
    calls: List[ToolCall] = field(default_factory=list)
    finish: Optional[str] = None
    """None until the last delta; then "stop", "length" or "tool_calls" (or another engine reason)."""
    matched_stop: Any = None
    """With finish "stop": the stop string that ended the text, or the stop token id (EOS), or None."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def chat_deltas(plan: ChatPlan, stream: GenerationStream) -> AsyncIterator[Delta]:
    """The deltas of the one choice of `stream` (n = 1). Held text ends as the chat route ends it
    (ChatPlan.parse_calls: calls, at most one with parallel_tool_calls false; a cut call is neither
    calls nor text). The caller owns and closes `stream`."""
    holding = plan.tool_mode is not None
    held: List[str] = []
    async for _, out in stream.iterate():
        if holding:
            held.append(out.text)
            if plan.tool_mode == "auto" and not tc.may_become_tool_call("".join(held)):
                holding = False
                yield Delta(text="".join(held))
                held = []
        elif out.text:
            yield Delta(text=out.text)
        if out.finish_reason is None:
            continue
        last = Delta(
            finish=out.finish_reason,
            matched_stop=out.matched_stop,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=out.completion_tokens,
        )
        if holding:
            text = "".join(held)
            calls = plan.parse_calls(text)
            if calls:
                last.calls, last.finish = calls, "tool_calls"
            elif text and not plan.is_cut_call(text):
                yield Delta(text=text)
        yield last
        return


async def run_chat(plan: ChatPlan, stream: GenerationStream) -> Delta:
    """The whole answer as one Delta (text joined, calls, finish, counts); closes `stream`."""
    texts: List[str] = []
    try:
        async for d in chat_deltas(plan, stream):
            texts.append(d.text)
            if d.finish is not None:
                d.text = "".join(texts)
                return d
    finally:
        await stream.close()
    raise APIError(500, "the stream ended without a finish", None, "internal_error")
