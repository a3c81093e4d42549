"""The engine on CUDA (skipped without a GPU): the greedy invariant across devices and dtypes.

float32 on the GPU must give exactly the CPU float32 tokens of the default model.
bfloat16 rounds every activation to 8 mantissa bits, and a different batch
shape picks a different GEMM kernel with a different summation order, so its
greedy path may leave the float32 one after a near-tie: it is checked for
agreement on the first tokens only.
"""
from __future__ import annotations

import pytest

from conftest import PROMPTS, assert_no_leak, make_engine

pytestmark = pytest.mark.gpu

GREEDY = {"temperature": 0.0, "max_new_tokens": 32}


@pytest.fixture(scope="module")
def cpu_reference(default_engine):
    return [o.token_ids for o in default_engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("options", [{}, dict(chunked_prefill_size=7, page_size=16)])
def test_cuda_float32_equals_cpu_float32(cpu_reference, options):
    with make_engine(device="cuda", dtype="float32", **options) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == cpu_reference
        assert [o.token_ids for o in engine.generate(PROMPTS[::-1], GREEDY)][::-1] == cpu_reference
        assert_no_leak(engine)


def test_cuda_bfloat16_agrees_on_first_tokens(cpu_reference):
    with make_engine(device="cuda", dtype="bfloat16") as engine:
        batch = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert sum(b[:4] == r[:4] for b, r in zip(batch, cpu_reference)) >= 6
        assert_no_leak(engine)
