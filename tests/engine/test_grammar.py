"""Structured output (xgrammar): JSON schema, JSON object, regex, EBNF; typed errors; greedy and
batch invariants; n > 1, streaming, stop strings, max_new_tokens, retraction; no KV leaks."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from engine_harness import assert_no_leak, make_engine
from engine import InvalidRequestError, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PERSON_JSON = json.dumps(PERSON)
PHONE = r"\d{3}-\d{4}"
EMAIL = r"[a-z]{3,8}@[a-z]{3,8}\.(com|org|net)"
CHOICE_EBNF = 'root ::= "yes" | "no" | "maybe"'
QUESTION = "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n"


def check_person(value) -> None:
    """Validate against PERSON (with jsonschema_rs when installed, plus a manual check)."""
    try:
        import jsonschema_rs
    except ImportError:  # pragma: no cover
        jsonschema_rs = None
    if jsonschema_rs is not None:
        jsonschema_rs.validate(PERSON, value)
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 10 for t in value["tags"])


def assert_ends_like_eos(engine, out) -> None:
    """A completed grammar ends with its stop token: in token_ids, not in the text."""
    assert out.finish_reason == "stop", out
    assert out.token_ids[-1] in engine.tokenizer.eos_token_ids and out.matched_stop == out.token_ids[-1]
    assert "<|im_end|>" not in out.text


def test_json_schema_50_samples_validate(default_engine):
    prompts = [
        f"<|im_start|>user\nDescribe person number {i} as JSON with name, age and tags.<|im_end|>\n"
        "<|im_start|>assistant\n"
        for i in range(5)
    ]
    params = [dict(json_schema=PERSON_JSON, temperature=1.0, n=10, seed=1000 * i, max_new_tokens=160) for i in range(5)]
    outs = default_engine.generate(prompts, params)
    assert len(outs) == 50
    for out in outs:
        assert_ends_like_eos(default_engine, out)
        check_person(json.loads(out.text))
    assert len({o.text for o in outs}) > 10  # really sampled
    assert default_engine.local_core.grammar.stats["hits"] >= 4  # one schema, compiled once for the five prompts
    assert_no_leak(default_engine)


def test_json_object(default_engine):
    prompt = (
        "<|im_start|>user\nGive me a short JSON object describing a cat, with its name and age.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    outs = default_engine.generate(
        [prompt, prompt],
        [
            dict(json_schema='{"type": "object"}', temperature=0, max_new_tokens=150),
            dict(json_schema='{"type": "object"}', temperature=0.7, n=5, seed=5, max_new_tokens=150),
        ],
    )
    for out in outs:
        assert out.finish_reason == "stop", out
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("pattern", [PHONE, EMAIL])
def test_regex_samples_fullmatch(default_engine, pattern):
    outs = default_engine.generate(
        ["My phone number and email are", "Contact:"],
        [dict(regex=pattern, temperature=1.0, n=10, seed=s, max_new_tokens=40) for s in (11, 22)],
    )
    for out in outs:
        assert_ends_like_eos(default_engine, out)
        assert re.fullmatch(pattern, out.text), out.text


def test_ebnf_choice(default_engine):
    outs = default_engine.generate(QUESTION, dict(ebnf=CHOICE_EBNF, temperature=1.0, n=8, seed=3, max_new_tokens=10))
    assert {o.text for o in outs} <= {"yes", "no", "maybe"}
    assert all(o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(json_schema="{not json"), "json_schema"),
        (dict(json_schema='{"type": "no-such-type"}'), "json_schema"),
        (dict(json_schema='{"oneOf": [{"type": "integer"}, {"type": "number"}]}'), "json_schema"),
        (dict(json_schema='{"required": [{"a": 1}], "minProperties": 3}'), "json_schema"),
        (dict(json_schema='{"items": ' * 3000 + "{}" + "}" * 3000), "json_schema"),  # nested too deeply
        (dict(lark="start: %json {"), "lark"),
        (dict(regex="a(b"), "regex"),
        (dict(ebnf='root ::= "a" |'), "ebnf"),
        (dict(ebnf='start ::= "a"'), "ebnf"),  # no root rule
    ],
)
def test_invalid_constraints_are_typed_errors(default_engine, bad, param):
    with pytest.raises(InvalidRequestError) as err:
        default_engine.generate("Hi", bad)
    assert err.value.param == param and "/project/" not in str(err.value), str(err.value)
    assert default_engine.generate("Hi", dict(max_new_tokens=2, regex="[ab]+")).completion_tokens >= 1
    assert_no_leak(default_engine)


def test_sampler_masks_to_allowed_tokens(default_engine):
    """Greedy grammar rows take the argmax over allowed tokens; sampled rows draw an allowed
    token; rows without a grammar are untouched."""
    from engine.runner.grammar import GrammarState
    from engine.runner.sampler import Sampler, SamplingBatchInfo

    vocab = default_engine.runner.vocab_size
    compiled = default_engine.local_core.grammar.compile(SamplingParams(regex=PHONE))
    states = [GrammarState(compiled), None, GrammarState(compiled)]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 5
    info = SamplingBatchInfo.build(
        params,
        seeds=[1, 2, 3],
        steps=[0, 0, 0],
        output_ids=[[]] * 3,
        prompt_ids=[[1]] * 3,
        vocab_size=vocab,
        device="cpu",
        grammars=states,
    )
    # Unpack row 0's bitmask independently: bit v of word v // 32.
    words = info.vocab_mask.bitmask[0].to(torch.int64) & 0xFFFFFFFF
    allowed = ((words.repeat_interleave(32)[:vocab] >> (torch.arange(vocab) % 32)) & 1).bool()
    digits = {t for t in range(vocab) if default_engine.tokenizer.decode([t]).isdigit()}
    assert set(allowed.nonzero().flatten().tolist()) <= digits and allowed.any()
    out = Sampler()(logits.clone(), info).next_token_ids.tolist()
    assert out[0] == int(logits[0].masked_fill(~allowed, float("-inf")).argmax())
    assert out[1] == int(logits[1].argmax())
    assert allowed[out[2]]


def test_greedy_constrained_is_deterministic_and_leaves_others_unchanged(default_engine):
    plain = [dict(temperature=0, max_new_tokens=16), dict(temperature=0.8, seed=9, max_new_tokens=16)]
    alone = [o.token_ids for o in default_engine.generate(["The capital of France is", "Once upon a time"], plain)]
    greedy_json = dict(json_schema=PERSON_JSON, temperature=0, max_new_tokens=120)
    mixed = default_engine.generate(
        ["The capital of France is", QUESTION, "Once upon a time", "Describe a person as JSON:"],
        [plain[0], dict(ebnf=CHOICE_EBNF, temperature=0), plain[1], greedy_json],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert mixed[1].text in {"yes", "no", "maybe"}
    check_person(json.loads(mixed[3].text))
    again = default_engine.generate("Describe a person as JSON:", greedy_json)
    assert again.token_ids == mixed[3].token_ids


def test_stream_stop_string_and_length(default_engine):
    params = dict(json_schema=PERSON_JSON, temperature=1.0, seed=4, max_new_tokens=160)
    full = default_engine.generate("A person as JSON:", params)

    async def collect():
        return [c async for c in default_engine.generate_stream("A person as JSON:", params)]

    chunks = asyncio.run(collect())
    assert "".join(c.text for c in chunks) == full.text
    assert sum((c.new_token_ids for c in chunks), []) == full.token_ids
    assert chunks[-1].finish_reason == "stop"
    # A stop string cuts the constrained text; max_new_tokens cuts the grammar with "length".
    stopped = default_engine.generate("Call", dict(regex=PHONE, temperature=1.0, seed=1, stop="-"))
    assert stopped.finish_reason == "stop" and stopped.matched_stop == "-" and re.fullmatch(r"\d{3}", stopped.text)
    cut = default_engine.generate("A person as JSON:", {**params, "max_new_tokens": 5})
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:5]
    assert_no_leak(default_engine)


def test_retraction_keeps_grammar_state(default_engine):
    """Retracted grammar requests resume without re-accepting their output: same tokens as
    without retraction (sampling is counter-based), still matching."""
    words = r"[a-z]{1,8}( [a-z]{1,8}){4,6}\."
    prompts = [f"Write sentence number {i} about the sea:" for i in range(8)]
    params = [dict(regex=words, temperature=1.0, seed=70 + i, max_new_tokens=60) for i in range(8)]
    reference = [o.token_ids for o in default_engine.generate(prompts, params)]
    with make_engine(max_total_tokens=96, page_size=4, new_token_ratio=0.0) as engine:
        outs = engine.generate(prompts, params)
        assert engine.stats().retractions > 0, engine.stats()
        assert [o.token_ids for o in outs] == reference
        for out in outs:
            assert out.finish_reason == "stop" and re.fullmatch(words, out.text), out
        assert_no_leak(engine)


@pytest.mark.gpu
def test_gpu_schema_and_regex_masks_on_cuda():
    """The grammar masks on the GPU path (bf16, CUDA graphs, GEMV decode): llguidance's JSON-schema masks and
    xgrammar's regex masks give outputs that validate, and every page comes back."""
    with make_engine(device="cuda", dtype="bfloat16") as engine:
        prompts = [
            f"<|im_start|>user\nDescribe person number {i} as JSON with name, age and tags.<|im_end|>\n"
            "<|im_start|>assistant\n"
            for i in range(3)
        ]
        params = [dict(json_schema=PERSON_JSON, temperature=1.0, n=8, seed=i, max_new_tokens=160) for i in range(3)]
        for out in engine.generate(prompts, params):
            assert_ends_like_eos(engine, out)
            check_person(json.loads(out.text))
        outs = engine.generate(["Contact:"], [dict(regex=EMAIL, temperature=1.0, n=8, seed=3, max_new_tokens=40)])
        for out in outs:
            assert_ends_like_eos(engine, out)
            assert re.fullmatch(EMAIL, out.text), out.text
        assert_no_leak(engine)


def test_grammar_byte_table_is_checked_against_the_tokenizer(default_engine):
    """llguidance's byte table must read the tokenizer's tokens back to the same text; a table that keeps a
    byte-level tokenizer's "Ġ" as two bytes (what some transformers versions gave it) is refused by name."""
    from engine.runner.grammar import token_bytes_mismatch

    compiler = default_engine.local_core.grammar
    table = compiler._llg_tokenizer("json_schema")
    tokenizer = compiler.hf_tokenizer
    assert token_bytes_mismatch(table.decode_bytes, tokenizer) is None

    def unmapped(ids):  # the raw token strings, byte-level marks left in
        return "".join(tokenizer.convert_ids_to_tokens(ids)).encode()

    def dummy_prefix(ids):  # a SentencePiece tokenizer's table: the text starts with its "▁" as a space
        return b" " + table.decode_bytes(ids)

    assert token_bytes_mismatch(dummy_prefix, tokenizer) is None
    problem = token_bytes_mismatch(unmapped, tokenizer)
    assert problem is not None and "disagrees with the tokenizer" in problem and "\\xc4\\xa0" in problem


def test_a_misread_byte_table_refuses_by_name_and_logs_the_library_versions(default_engine, monkeypatch, caplog):
    """When the check fails, the request gets an InvalidRequestError naming its field (HTTP 400), the server's log
    names the installed transformers / tokenizers / llguidance (what decides the table) once, and later
    requests are refused without rebuilding the table."""
    import logging

    import engine.runner.grammar as grammar

    used = default_engine.local_core.grammar
    compiler = grammar.GrammarCompiler(used.hf_tokenizer, used.vocab_size, used.stop_token_ids)
    monkeypatch.setattr(grammar, "token_bytes_mismatch", lambda decode, tok: "its byte table disagrees")
    with caplog.at_level(logging.WARNING, logger="engine.runner.grammar"):
        with pytest.raises(InvalidRequestError) as err:
            compiler.compile(SamplingParams(max_new_tokens=4, json_schema='{"type": "object"}'))
    assert err.value.param == "json_schema" and "not supported for this tokenizer" in str(err.value)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == 1 and "transformers " in logged[0] and "llguidance " in logged[0]
    # The next request is refused the same way, without building the table or logging again.
    monkeypatch.setattr(grammar, "token_bytes_mismatch", lambda decode, tok: pytest.fail("checked again"))
    with pytest.raises(InvalidRequestError, match="its byte table disagrees") as err:
        compiler.compile(SamplingParams(max_new_tokens=4, lark="start: /[a-z]+/"))
    assert err.value.param == "lark"
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_a_tokenizer_xgrammar_cannot_read_refuses_regex_and_ebnf_once_logged(default_engine, monkeypatch, caplog):
    """When xgrammar cannot build its tokenizer table, regex and EBNF requests get an InvalidRequestError naming
    their field, the log names the versions once, and later requests are refused without retrying xgrammar."""
    import logging

    import xgrammar

    import engine.runner.grammar as grammar

    used = default_engine.local_core.grammar
    compiler = grammar.GrammarCompiler(used.hf_tokenizer, used.vocab_size, used.stop_token_ids)
    calls = []

    def unreadable(*args, **kwargs):
        calls.append(1)
        raise ValueError("no byte-level decoder found")

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", unreadable)
    with caplog.at_level(logging.WARNING, logger="engine.runner.grammar"):
        with pytest.raises(InvalidRequestError, match="no byte-level decoder found") as err:
            compiler.compile(SamplingParams(max_new_tokens=4, regex="[a-z]+"))
        assert err.value.param == "regex" and "not supported for this tokenizer" in str(err.value)
        with pytest.raises(InvalidRequestError, match="no byte-level decoder found") as err:
            compiler.compile(SamplingParams(max_new_tokens=4, ebnf='root ::= "a"'))
    assert err.value.param == "ebnf" and calls == [1]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == 1 and "xgrammar " in logged[0] and "transformers " in logged[0]
