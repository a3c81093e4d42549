"""Request parameters of OpenAI's API that the server does not honour: each is refused with a 400
naming it, unless it is null or holds the value that means what the server does anyway.

The tables cover every property of OpenAI's CreateChatCompletionRequest / CreateCompletionRequest
that no route honours (tests/serving/test_serving_params.py walks the published schema and fails on
a parameter in no table). Parameters honoured are handled where they act (chat.py, completions.py,
state.py); this module only refuses.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from serving.errors import APIError

Accepts = Callable[[Any], bool]
"""Whether a (non-null) value of the parameter is one the server honours."""


def _never(_: Any) -> bool:
    return False


CHAT_REFUSED: Dict[str, tuple[Accepts, str]] = {
    "functions": (_never, "deprecated; send tools instead"),
    "function_call": (_never, "deprecated; send tool_choice instead"),
    "audio": (_never, "no audio output"),
    "modalities": (lambda v: list(v) == ["text"], 'only ["text"] is supported'),
    "verbosity": (lambda v: v == "medium", 'only "medium" (the default) is supported'),
    "reasoning_effort": (_never, "the served model does not reason"),
    "web_search_options": (_never, "web search is not supported"),
    "prediction": (_never, "predicted outputs are not supported"),
    "service_tier": (lambda v: v in ("auto", "default"), 'only "auto" or "default" (one tier)'),
    "store": (lambda v: v is False, "nothing is stored; only store=false"),
    "prompt_cache_retention": (lambda v: v == "in_memory", 'only "in_memory" (the radix cache)'),
    "prompt_cache_options": (_never, "not supported"),
    "moderation": (_never, "moderation is not supported"),
}
"""Chat parameters refused: name → (values honoured, why the others are not)."""

COMPLETION_REFUSED: Dict[str, tuple[Accepts, str]] = {
    "suffix": (lambda v: v == "", "insertion (suffix) is not supported"),
}
"""Completions parameters refused (best_of is honoured only as best_of == n: completions.py)."""


def refuse_unsupported(body: Any, table: Dict[str, tuple[Accepts, str]]) -> None:
    """400 naming the first parameter of `table` that `body` sets to a value the server does not honour."""
    for name, (accepts, why) in table.items():
        value = getattr(body, name, None)
        if value is not None and not accepts(value):
            raise APIError(400, f"{name} = {value!r} is not supported: {why}", name, "unsupported_parameter")
