"""JSON schemas from JSONSchemaBench (tests/data/jsonschemabench) through the engine's grammar path,
without a model: each schema is compiled or refused with a typed error naming the feature; a
compiled grammar rejects every invalid test instance, and every output a random walk over its
token masks completes validates (jsonschema). Cheap: a tokenizer, no forward passes."""

from __future__ import annotations

import glob
import json
import os
import random

import jsonschema
import numpy as np
import pytest

from engine import InvalidRequestError, SamplingParams
from engine.models.source import resolve_model
from engine.runner.grammar import GrammarCompiler, GrammarState, LlgGrammar, build_vocab_mask
from engine.tokenizer import load_tokenizer

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "jsonschemabench")
FILES = sorted(glob.glob(os.path.join(DATA, "*.json")))
# Words a refusal may use to name what is unsupported (llguidance's and engine/runner/json_schema.py's).
FEATURE_WORDS = ("keyword", "oneOf", "format", "$ref", "pattern", "minProperties", "maxProperties", "intersection")


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def compiler():
    tok = load_tokenizer(resolve_model(None))
    return GrammarCompiler(tok.hf, len(tok.hf), tok.eos_token_ids), tok


def allowed_tokens(state: GrammarState, vocab: int) -> np.ndarray:
    mask = build_vocab_mask([state], vocab, __import__("torch").device("cpu"))
    bits = np.unpackbits(mask.bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def feed(state: GrammarState, ids) -> bool:
    return all(state.accept(t) for t in ids)


def test_dataset_is_the_documented_sample():
    assert len(FILES) >= 40
    for path in FILES:
        d = load(path)
        assert isinstance(d["schema"], dict) and d["tests"], path


def test_every_schema_compiles_or_is_refused_by_name(compiler):
    comp, _ = compiler
    compiled = refused = 0
    for path in FILES:
        schema = load(path)["schema"]
        try:
            grammar = comp.compile(SamplingParams(json_schema=json.dumps(schema)))
        except InvalidRequestError as err:
            refused += 1
            msg = str(err)
            assert err.param == "json_schema" and msg.startswith("unsupported JSON schema: "), (path, msg)
            assert any(w in msg for w in FEATURE_WORDS) and "coerce_one_of" not in msg, (path, msg)
            continue
        assert isinstance(grammar, LlgGrammar)
        compiled += 1
    assert compiled >= 40 and refused >= 1, (compiled, refused)


def test_compiled_grammars_reject_every_invalid_instance(compiler):
    """Soundness on the dataset's own instances (json.dumps spacing, the form the grammar generates).
    Valid instances may be rejected (fixed property order, closed objects), but most are accepted."""
    comp, tok = compiler
    eos = min(tok.eos_token_ids)
    invalid_checked = valid_total = valid_accepted = 0
    for path in FILES:
        d = load(path)
        try:
            grammar = comp.compile(SamplingParams(json_schema=json.dumps(d["schema"])))
        except InvalidRequestError:
            continue
        validator = jsonschema.validators.validator_for(d["schema"])(d["schema"])
        for case in d["tests"]:
            text = json.dumps(case["data"], ensure_ascii=False)
            ids = tok.hf.encode(text, add_special_tokens=False) + [eos]
            accepted = feed(GrammarState(grammar), ids)
            if validator.is_valid(case["data"]):
                valid_total += 1
                valid_accepted += accepted
            else:
                invalid_checked += 1
                assert not accepted, (os.path.basename(path), case.get("description"), text[:200])
    assert invalid_checked >= 100
    assert valid_accepted >= 0.8 * valid_total, (valid_accepted, valid_total)


def test_random_walks_that_complete_validate(compiler):
    """Model-free generation for at most 192 tokens: EOS with probability 1/2 when allowed, else with
    probability 1/2 a token that closes something (holds '"', '}' or ']'), else any allowed token.
    Every walk that ends on EOS must be a valid instance, in compact JSON."""
    comp, tok = compiler
    vocab = len(tok.hf)
    stops = set(tok.eos_token_ids)
    closers = np.array([any(c in tok.hf.decode([t]) for c in '"}]') for t in range(vocab)])
    rng = random.Random(0)
    completed = 0
    for path in FILES:
        schema = load(path)["schema"]
        try:
            grammar = comp.compile(SamplingParams(json_schema=json.dumps(schema)))
        except InvalidRequestError:
            continue
        validator = jsonschema.validators.validator_for(schema)(schema)
        for _ in range(2):
            state, ids = GrammarState(grammar), []
            for _ in range(192):
                allowed = allowed_tokens(state, vocab)
                assert len(allowed), (path, tok.hf.decode(ids))
                ends = [t for t in allowed if t in stops]
                closing = allowed[closers[allowed]]
                if ends and rng.random() < 0.5:
                    token = ends[0]
                elif len(closing) and rng.random() < 0.5:
                    token = int(closing[rng.randrange(len(closing))])
                else:
                    token = int(allowed[rng.randrange(len(allowed))])
                assert state.accept(token)
                if state.is_terminated():
                    break
                ids.append(token)
            if not state.is_terminated():
                continue
            completed += 1
            text = tok.hf.decode(ids)
            errors = [e.message for e in validator.iter_errors(json.loads(text))]
            assert not errors, (os.path.basename(path), text[:300], errors[:2])
            assert not any(c in text for c in "\n\r\t"), text[:300]  # compact: no whitespace but in strings
    assert completed >= 20, completed
