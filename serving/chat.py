"""POST /v1/chat/completions: messages → chat template → ids → choices, JSON or SSE.

    ChatCompletionRequest ──template_messages──▶ dicts the template takes (text parts flattened,
        tool calls rendered) ──ChatPlan──▶ prompt ids + SamplingParams (+ json_schema from
        response_format or a forced tool choice) ──GenerationStream──▶ ChoiceState / chunks

Tool modes (`ChatPlan.tool_mode`): None (no tools or tool_choice "none"), "auto" (output parsed
for a call; constrained to free text or strict calls when a tool is `strict`), "forced" ("required"
or a named function: the output is constrained to a call, or with "required" one or more).
A forced call cut by max_tokens gives content null, no tool_calls and finish_reason "length".
Parameters the server does not honour are refused first (serving/unsupported.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from fastapi import APIRouter, Request

from engine.errors import InvalidRequestError
from engine.runner.json_schema import json_schema_grammar
from serving import tool_calls as tc
from serving.chat_stream import chat_events, logprob_entries
from serving.errors import APIError
from serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    Tool,
    new_id,
)
from serving.state import ServingState, get_state
from serving.streams import cancel_on_disconnect, collect, stream_response
from serving.unsupported import CHAT_REFUSED, refuse_unsupported

router = APIRouter()


def flatten_content(content: Any, where: str) -> str:
    """A message's content as one string: text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400, f"{where}: only text content parts are supported, got {part.type!r}", "messages", "unsupported"
            )
        texts.append(part.text)
    return "\n".join(texts)


def template_messages(messages: List[ChatMessage], renders_tools: bool) -> List[Dict[str, Any]]:
    """Messages as the chat template takes them. Without template tool support, an assistant's
    tool calls become the JSON the model was asked to produce."""
    out = []
    for i, m in enumerate(messages):
        msg: Dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": flatten_content(m.content, f"messages[{i}]"),
        }
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _loads_or_str(c.function.arguments)} for c in m.tool_calls]
            if renders_tools:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": f} for c, f in zip(m.tool_calls, calls)
                ]
            else:
                rendered = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
                msg["content"] = f"{msg['content']}\n{rendered}".strip()
        out.append(msg)
    return out


def _loads_or_str(s: str) -> Any:
    try:
        return json.loads(s)
    except (json.JSONDecodeError, TypeError):
        return s


@dataclass
class ChatPlan:
    prompt_ids: List[int]
    json_schema: Optional[str]
    tool_mode: Optional[str]
    tools: List[Tool]
    """The tools a call may name (all of them, or the named one)."""
    lark: Optional[str] = None
    """The grammar of "auto" with a strict tool (free text or strict calls; tool_calls.py)."""
    parallel_tool_calls: Optional[bool] = None

    def parse_calls(self, text: str) -> Optional[List[Any]]:
        """The tool calls in a choice's text (None: it is content, or a cut call: see `is_cut_call`)."""
        if not self.tool_mode:
            return None
        bare = self.tool_mode == "forced" or self.lark is not None
        return tc.parse_tool_calls(text, self.tools, bare=bare, parallel=self.parallel_tool_calls)

    def is_cut_call(self, text: str) -> bool:
        """Text that is neither content nor a call: a forced (or strict "auto") call cut short."""
        return bool(self.tool_mode) and tc.is_cut_call(text, self.tool_mode == "forced", self.lark is not None)


def _check_schema(schema: Dict[str, Any], what: str) -> None:
    """400 unless `schema` is a valid JSON schema (against the meta-schema of the draft it names)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise APIError(400, f"{what} is not a valid JSON schema: {exc.message}", "tools", "invalid_request") from exc


def _answer_schema(body: ChatCompletionRequest) -> Optional[Dict[str, Any]]:
    """The schema response_format asks for (None: free text); 400 unless it can be enforced exactly."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema is required", "response_format", "invalid_request")
    try:
        json_schema_grammar(fmt.json_schema.schema_)
    except InvalidRequestError as exc:
        raise APIError(400, f"response_format: {exc}", "response_format", "invalid_request") from exc
    return fmt.json_schema.schema_


async def plan_chat(st: ServingState, body: ChatCompletionRequest) -> ChatPlan:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools and choice != "none":
        raise APIError(400, "tool_choice needs a non-empty tools list", "tool_choice", "invalid_request")
    if len({t.function.name for t in tools}) != len(tools):
        raise APIError(400, "tool names must be unique", "tools", "invalid_request")
    for tool in tools:
        _check_schema(tool.function.parameters, f"tool {tool.function.name!r}: parameters")
    try:
        allowed = tc.selected_tools(tools, choice) if tools else []
    except KeyError as exc:
        raise APIError(
            400, f"tool_choice names an unknown function {exc.args[0]!r}", "tool_choice", "invalid_request"
        ) from exc
    tool_mode = None if choice == "none" else "auto" if choice == "auto" else "forced"
    renders = bool(tool_mode) and tc.template_renders_tools(st.tokenizer)
    messages = template_messages(body.messages, renders)
    template_tools = None
    if tool_mode and renders:
        template_tools = [t.model_dump(exclude_none=True) for t in allowed]
    elif tool_mode:
        messages = tc.inject_tools(messages, allowed, choice)
    kwargs = {}
    if body.continue_final_message:
        kwargs["continue_final_message"] = True
    text = st.tokenizer.chat_prompt_text(
        messages,
        tools=template_tools,
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        **kwargs,
    )
    ids = await st.encode(text, add_special_tokens=False, param="messages")  # the template wrote the specials
    answer = _answer_schema(body)
    schema = lark = None
    if tool_mode == "forced":
        schema = tc.forced_schema(allowed, choice, body.parallel_tool_calls)
    elif tool_mode == "auto" and tc.any_strict(allowed):
        lark = tc.strict_auto_grammar(allowed, body.parallel_tool_calls, answer)
    elif answer is not None:
        schema = json.dumps(answer)
    return ChatPlan(ids, schema, tool_mode, allowed, lark, body.parallel_tool_calls)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    st = get_state(request)
    st.check_model(body.model)
    refuse_unsupported(body, CHAT_REFUSED)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_request")
    plan = await plan_chat(st, body)
    st.check_ids(plan.prompt_ids, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = st.check_context(len(plan.prompt_ids), requested, "messages")
    params = st.sampling_params(
        body,
        max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        json_schema=plan.json_schema,
        lark=plan.lark,
    )
    rid = new_id("chatcmpl")
    stream = await st.start_stream([plan.prompt_ids], params, rid, body.timeout, request)
    if body.stream:
        return stream_response(stream, chat_events(st, body, plan, rid, stream))
    states = await cancel_on_disconnect(request, collect(stream, 1, params.n))
    choices = []
    for k, s in enumerate(states):
        text, finish = s.full_text, s.finish_reason
        calls = plan.parse_calls(text)
        message = AssistantMessage(content=None if calls or plan.is_cut_call(text) else text, tool_calls=calls)
        lps = ChoiceLogprobs(content=logprob_entries(st, s.logprobs)) if body.logprobs else None
        choices.append(
            ChatChoice(index=k, message=message, logprobs=lps, finish_reason="tool_calls" if calls else finish)
        )
    usage = st.usage(states[0].prompt_tokens, states[0].cached_tokens, sum(s.completion_tokens for s in states))
    return ChatCompletionResponse(id=rid, model=st.model_name, choices=choices, usage=usage)
