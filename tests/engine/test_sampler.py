"""Sampler: greedy, seeded reproducibility, distribution, filters, penalties, logprobs (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.runner.sampler import Sampler, SamplingBatchInfo, gumbel_noise, uniform_noise
from engine.sampling_params import SamplingParams

V = 1003  # deliberately not a multiple of any SIMD width


def build(params, seeds=None, steps=None, outputs=None, prompts=None, vocab=V):
    bs = len(params)
    return SamplingBatchInfo.build(
        params,
        seeds if seeds is not None else list(range(bs)),
        steps if steps is not None else [0] * bs,
        outputs if outputs is not None else [[] for _ in range(bs)],
        prompts if prompts is not None else [[] for _ in range(bs)],
        vocab,
        "cpu",
    )


def sample(logits, params, **kw):
    return Sampler()(logits.clone(), build(params, vocab=logits.shape[1], **kw))


def fixed_logits(key: int, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(key)
    return torch.randn(vocab, generator=g) * 3


# --- greedy ----------------------------------------------------------------------------------
def test_greedy_is_argmax_with_lowest_index_ties():
    logits = torch.randn(6, V)
    logits[1, [7, 500, 900]] = 100.0  # tie: lowest index wins
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.7, top_k=1)]
    out = sample(logits, params)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids[1].item() == 7


def test_greedy_rows_in_mixed_batch_are_exact_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    params = [
        SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.5, top_p=0.5) for i in range(8)
    ]
    out = sample(logits, params)
    assert torch.equal(out.next_token_ids[1::2], logits[1::2].argmax(-1))


# --- seeded reproducibility ------------------------------------------------------------------
def test_noise_depends_only_on_seed_step_token():
    seeds, steps = torch.tensor([5, 2**62 + 3, 0, 5]), torch.tensor([0, 7, 0, 1])
    batch = gumbel_noise(seeds, steps, V)
    for i in range(4):
        assert torch.equal(batch[i], gumbel_noise(seeds[i : i + 1], steps[i : i + 1], V)[0])
    assert not torch.equal(batch[0], batch[3])  # same seed, next step
    u = uniform_noise(seeds, steps, V)
    assert 0.0 < u.min().item() and u.max().item() < 1.0


def test_seeded_request_is_independent_of_batch_companions_and_order():
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, min_p=0.01, seed=1234)
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    alone, batched = [], {2: [], 5: []}
    for step in range(40):
        logits = fixed_logits(step)
        alone.append(sample(logits.unsqueeze(0), [target], seeds=[1234], steps=[step]).next_token_ids.item())
        for bs, pos in ((2, 1), (5, 3)):
            others = companions[: bs - 1]
            params = others[:pos] + [target] + others[pos:]
            seeds = [99 + j for j in range(bs)]
            seeds[pos] = 1234
            rows = torch.stack([fixed_logits(1000 + step * 7 + j) for j in range(bs)])
            rows[pos] = logits
            out = sample(
                rows,
                params,
                seeds=seeds,
                steps=[step + 3 * j for j in range(bs)][:pos] + [step] + [step + 1] * (bs - pos - 1),
            )
            batched[bs].append(out.next_token_ids[pos].item())
    assert alone == batched[2] == batched[5]
    assert len(set(alone)) > 5  # actually random across steps


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, V)  # uniform distribution over V tokens
    runs = [
        [sample(logits, [SamplingParams(seed=s)], seeds=[s], steps=[t]).next_token_ids.item() for t in range(20)]
        for s in (1, 2, 3)
    ]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


# --- distribution ----------------------------------------------------------------------------
def empirical(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Frequencies over n (seed, step) pairs, sampled as one batch of n identical rows."""
    logits = logits_row.repeat(n, 1)
    seeds = [i // 4 for i in range(n)]
    steps = [i % 4 for i in range(n)]
    ids = sample(logits, [params] * n, seeds=seeds, steps=steps).next_token_ids
    return torch.bincount(ids, minlength=logits.shape[1]).double() / n


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_softmax(temperature):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40000
    freq = empirical(row, SamplingParams(temperature=temperature), n)
    probs = torch.softmax(row.double() / temperature, -1)
    chi2 = (n * (freq - probs) ** 2 / probs).sum().item()
    assert chi2 < 25.0, (chi2, freq, probs)  # df=5: p(chi2 > 25) ~ 1e-4


def test_temperature_sharpens():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0])
    hot, cold = (empirical(row, SamplingParams(temperature=t), 20000) for t in (2.0, 0.3))
    assert cold[0] > 0.95 > torch.softmax(row, -1)[0] > hot[0]


# --- filters ---------------------------------------------------------------------------------
def test_filters_never_pick_masked_tokens():
    torch.manual_seed(1)
    row = torch.randn(50) * 2
    probs = torch.softmax(row, -1)
    order = probs.argsort(descending=True)
    n = 3000
    cases = {
        "top_k": (SamplingParams(top_k=5), set(order[:5].tolist())),
        "top_p": (
            SamplingParams(top_p=0.6),
            set(order[: int((probs[order].cumsum(0) - probs[order] <= 0.6).sum())].tolist()),
        ),
        "min_p": (SamplingParams(min_p=0.3), set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())),
    }
    for name, (params, allowed) in cases.items():
        seen = set(torch.nonzero(empirical(row, params, n)).flatten().tolist())
        assert seen <= allowed, name
        assert len(seen) == len(allowed), name  # every kept token does occur


def test_top_p_renormalises_after_top_k():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # After top_k=2 the kept mass is (4/7, 3/7): top_p=0.5 keeps only the best token.
    assert set(torch.nonzero(empirical(row, SamplingParams(top_k=2, top_p=0.5), 500)).flatten().tolist()) == {0}


# --- penalties -------------------------------------------------------------------------------
def reference_penalties(logits, p: SamplingParams, prompt, output):
    out = logits.tolist()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(out)


def test_penalties_match_python_reference():
    vocab = 12
    torch.manual_seed(2)
    logits = torch.randn(4, vocab) * 2
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.5),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2, 2, 9], [3, 4], [0, 5, 11], [1, 2]]
    outputs = [[4, 4, 7], [3, 3, 3, 6], [5, 5, 10], [1]]
    info = build(params, outputs=outputs, prompts=prompts, vocab=vocab)
    penalised = logits.clone()
    info.penalties.apply_(penalised)
    expected = torch.stack([reference_penalties(logits[i], params[i], prompts[i], outputs[i]) for i in range(4)])
    torch.testing.assert_close(penalised, expected)
    # Repetition counts prompt-only tokens (1, 2, 9 in row 0).
    assert penalised[0, 9] != logits[0, 9] and penalised[0, 3] == logits[0, 3]
    out = Sampler()(logits.clone(), info)
    assert torch.equal(out.next_token_ids, expected.argmax(-1))


def test_no_penalty_tensors_when_unused():
    assert build([SamplingParams(), SamplingParams(temperature=0.0)]).penalties is None


# --- logprobs --------------------------------------------------------------------------------
def test_logprobs_and_top_logprobs():
    torch.manual_seed(3)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=1.2, top_p=0.9),
    ]
    out = sample(logits, params)
    ref = torch.log_softmax(logits, -1)  # pre-temperature, pre-filter
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.next_token_ids[:, None]).squeeze(1))
    vals, ids = torch.topk(ref, 5, dim=-1)
    assert out.top_logprob_ids.shape == (3, 5)
    assert torch.equal(out.top_logprob_ids, ids)
    torch.testing.assert_close(out.top_logprob_vals, vals)
    assert bool((out.top_logprob_vals[:, :-1] >= out.top_logprob_vals[:, 1:]).all())


def test_logprobs_are_penalised_but_pre_temperature():
    logits = torch.randn(1, 16)
    params = [SamplingParams(temperature=0.5, presence_penalty=1.0, logprobs=True)]
    out = sample(logits, params, outputs=[[3]])
    penalised = logits.clone()
    penalised[0, 3] -= 1.0
    expected = torch.log_softmax(penalised, -1)[0, out.next_token_ids[0]]
    assert math.isclose(out.logprobs[0].item(), expected.item(), rel_tol=1e-5, abs_tol=1e-6)


def test_no_logprobs_unless_asked():
    out = sample(torch.randn(2, V), [SamplingParams(), SamplingParams(temperature=0.0)])
    assert out.logprobs is None and out.top_logprob_ids is None


# --- logit_bias ------------------------------------------------------------------------------
def _bias_cases(device):
    logits = torch.stack([fixed_logits(k) for k in range(4)]).to(device)
    best = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={best[0]: -100}),  # the greedy pick is banned
        SamplingParams(temperature=0.0, logit_bias={"17": 100}),  # a token forced (a JSON key: a string)
        SamplingParams(temperature=1.0, logit_bias={23: 100}),  # forced in a sampled row too
        SamplingParams(temperature=0.0),  # no bias: untouched
    ]
    return logits, best, params


def _check_bias(device):
    logits, best, params = _bias_cases(device)
    info = SamplingBatchInfo.build(params, [1, 2, 3, 4], [0] * 4, [[]] * 4, [[]] * 4, V, device)
    out = Sampler()(logits.clone(), info)
    ids = out.next_token_ids.tolist()
    second = logits[0].clone()
    second[best[0]] = float("-inf")
    assert ids == [second.argmax().item(), 17, 23, best[3]]


def test_logit_bias_bans_and_forces_tokens():
    _check_bias("cpu")
    assert build([SamplingParams()]).logit_bias is None  # no bias: nothing built, nothing applied


def test_logit_bias_shifts_the_logprobs():
    logits = fixed_logits(5).unsqueeze(0)
    biased = SamplingParams(temperature=0.0, logprobs=True, logit_bias={3: 2.5})
    out = Sampler()(logits.clone(), build([biased]))
    ref = logits.clone()
    ref[0, 3] += 2.5
    assert out.next_token_ids.item() == ref.argmax().item()
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(ref, -1).max().item(), abs=1e-5)


@pytest.mark.parametrize(
    "bias, message",
    [({"x": 1}, "token ids"), ({-1: 1}, "token ids"), ({1: 101}, "[-100, 100]"), ({1: float("nan")}, "[-100")],
)
def test_logit_bias_is_validated(bias, message):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[")) as info:
        SamplingParams.from_any({"logit_bias": bias})
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_any({"logit_bias": {V: 1}}).check_vocab(V)
    assert info.value.param == "logit_bias"


@pytest.mark.gpu
def test_logit_bias_on_cuda():
    _check_bias("cuda")
