"""Continuation: a request whose worker died mid-stream goes on elsewhere from its tokens so far. The
end-to-end runs (a worker or a decode replica killed under 16 streams) are in test_cluster.py and
test_disaggregated_admin.py."""

import pytest

pytest.importorskip("ray")

from cluster.ingress.backend import Continuation  # noqa: E402
from engine.outputs import StreamOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def _out(tokens, completion, prompt=5, cached=2, finish=None):
    return StreamOutput("r", 0, tokens, "", None, finish, None, prompt, cached, completion)


def test_next_attempt_carries_the_tokens_so_far_and_what_is_left_of_the_budget():
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    c = Continuation([1, 2, 3, 4, 5], params)
    assert c.attempt() == ([1, 2, 3, 4, 5], params)
    assert c.seen(_out([7], 1)).completion_tokens == 1
    c.seen(_out([8, 9], 3))
    ids, resumed = c.attempt()
    assert ids == [1, 2, 3, 4, 5, 7, 8, 9] and resumed.max_new_tokens == 7 and resumed.temperature == 0.0
    # the new worker counts from its own prompt; the client sees one request
    out = c.seen(_out([10], 1, prompt=8, cached=8))
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (5, 4, 2)
    assert out.new_token_ids == [10]
    assert c.attempt()[0] == [1, 2, 3, 4, 5, 7, 8, 9, 10] and c.attempt()[1].max_new_tokens == 6


@pytest.mark.parametrize(
    "params, resumable",
    [
        (SamplingParams(), True),
        (SamplingParams(n=2), False),
        (SamplingParams(json_schema='{"type": "object"}'), False),
        (SamplingParams(regex="[a-z]+"), False),
        (SamplingParams(prompt_logprobs=1), False),
    ],
)
def test_only_what_can_be_resumed_is(params, resumable):
    c = Continuation([1, 2], params)
    assert c.resumable is resumable
    assert c.seen(_out([7, 8], 2)).new_token_ids == [7, 8]
    assert c.generated == ([7, 8] if resumable else [])  # tokens are kept only for a request that may resume
    assert c.attempt()[0] == ([1, 2, 7, 8] if resumable else [1, 2])
