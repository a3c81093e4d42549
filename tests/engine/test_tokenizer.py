"""engine.tokenizer: loading, chat template, incremental detokenization, stop strings (CPU, no network)."""

import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from engine.errors import InvalidRequestError
from engine.models.source import ModelSource, resolve_model
from engine.tokenizer import IncrementalDetokenizer, StopResult, StopStringMatcher, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text 🚀!",
    " 你好世界，这是一个测试。日本語のテキストも。한국어 문장.",
    "Accents: café naïve résumé Ångström façade — “quotes” …",
    "Math ∑∫√∞ ≠ ≈ and arrows ←→ plus tabs\tand\nnewlines\n\n  spaces",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def metaspace_tok(tmp_path_factory):
    """A tiny SentencePiece-style (Metaspace) tokenizer in a HF folder with generation_config.json."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁": 6, "é": 7, "▁caf": 8}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    folder = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", bos_token="<s>", unk_token="<unk>").save_pretrained(
        folder
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    return load_tokenizer(ModelSource(name="metaspace", folder=str(folder)))


def test_encode_batch_gives_encode_ids(tok, metaspace_tok):
    """One batch call gives each text the ids `encode` gives it, also where the Rust backend was set to
    truncate (transformers turns that off per call; encode_batch then encodes through transformers)."""
    import copy

    from engine.tokenizer import Tokenizer

    texts = ["Hello world!", "", " café", "<|im_start|>user\nhi<|im_end|>\n", "Hello world! " * 50]
    truncating = copy.deepcopy(metaspace_tok.hf)
    truncating.backend_tokenizer.enable_truncation(2)
    for t in (tok, metaspace_tok, Tokenizer(truncating)):
        for special in (True, False):
            assert t.encode_batch(texts, special) == [t.encode(x, special) for x in texts]
    assert len(Tokenizer(truncating).encode_batch(["Hello world! Hello"])[0]) > 2


def test_decode_is_transformers_decode(tok, metaspace_tok):
    """`decode` calls the Rust backend directly for plain fast tokenizers: the text is transformers' own
    `decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)` for random ids with special
    tokens mixed in (byte-level BPE and Metaspace), skipped or kept."""
    rng = random.Random(7)
    for t in (tok, metaspace_tok):
        assert t._rust_decode is not None
        specials = sorted(t.hf.all_special_ids)
        for _ in range(500):
            ids = [rng.randrange(t.vocab_size) for _ in range(rng.randrange(0, 10))] + rng.sample(specials, 2)
            rng.shuffle(ids)
            for skip in (True, False):
                want = t.hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                assert t.decode(ids, skip) == want
                assert t.decode(tuple(ids), skip) == want


def test_decode_keeps_a_tokenizer_classes_own_decoding(metaspace_tok):
    """A tokenizer class that overrides `_decode` keeps it: `decode` then goes through transformers."""
    from engine.tokenizer import Tokenizer

    class Shouting(type(metaspace_tok.hf)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    hf = metaspace_tok.hf
    shouting = Tokenizer(Shouting(tokenizer_object=hf.backend_tokenizer, eos_token="</s>"))
    assert shouting._rust_decode is None
    assert shouting.decode([3, 4, 5]) == "HELLO WORLD!" == hf.decode([3, 4, 5]).upper()


def stream(detok, ids, chunk_sizes=(1,)):
    """Feed `ids` in chunks cycling through `chunk_sizes`; return the list of deltas incl. flush."""
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = chunk_sizes[k % len(chunk_sizes)]
        deltas.append(detok.step(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(detok.flush())
    return deltas


# ---- loading, encode/decode, chat template -------------------------------------------------------


def test_load_is_cached_and_declares_eos(tok):
    assert load_tokenizer(resolve_model(None)) is tok
    assert tok.vocab_size == len(tok.hf) == 49152
    assert tok.eos_token_ids == frozenset({2})
    assert tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"


def test_hf_folder_eos_includes_generation_config(metaspace_tok):
    assert metaspace_tok.eos_token_ids == frozenset({1, 5})
    assert metaspace_tok.decode([3, 4, 5]) == "Hello world!"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_roundtrip(tok, text):
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_encode_rejects_non_string(tok):
    with pytest.raises(InvalidRequestError):
        tok.encode(["not", "text"])


def test_chat_template_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tok.chat_prompt_text(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert ids == list(
        tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    assert ids[0] == 1 and ids.count(2) == 2 and tok.decode(ids, skip_special_tokens=False) == text
    no_gen = tok.chat_prompt_text(messages, add_generation_prompt=False)
    assert no_gen.endswith("<|im_end|>\n") and not no_gen.endswith("assistant\n")


def test_chat_template_default_system_prompt(tok):
    text = tok.chat_prompt_text([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        ["not a dict"],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],  # this template concatenates strings
    ],
)
def test_chat_template_malformed_messages(tok, messages):
    with pytest.raises(InvalidRequestError) as err:
        tok.apply_chat_template(messages)
    assert err.value.param == "messages"


def test_chat_template_missing(metaspace_tok):
    with pytest.raises(InvalidRequestError, match="no chat template"):
        metaspace_tok.apply_chat_template([{"role": "user", "content": "Hi"}])


# ---- incremental detokenization ------------------------------------------------------------------


def _split_char_tokens(tok):
    """Token ids where some token decodes alone to U+FFFD (a character split across tokens)."""
    ids = tok.encode("🎉 你好世界", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test needs a multi-byte char split across tokens"
    return ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>assistant\nSure 👍<|im_end|>\n<|endoftext|>"])
def test_deltas_concatenate_to_decode(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids, skip_special_tokens=skip)
    for chunks in [(1,), (2,), (3, 1), (len(ids),)]:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = stream(detok, ids, chunks)
        assert "".join(deltas) == expected == detok.text
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "Hi"
    assert "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)) == "Hi<|im_end|>"


def test_split_character_is_held_back_until_complete(tok):
    ids = _split_char_tokens(tok)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([i]) for i in ids] + [detok.flush()]
    assert "" in deltas[:-1]  # something was held back at least once
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == "🎉 你好世界"


def test_prompt_context_byte_level(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi"}])
    out = tok.encode(" Hello there 😀 — ça va? 你好", add_special_tokens=False) + [2]
    for skip in (True, False):
        for chunks in [(1,), (4,), (len(out),)]:
            detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
            assert "".join(stream(detok, out, chunks)) == tok.decode(out, skip_special_tokens=skip)


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:cut])
    assert "".join(stream(detok, ids[cut:])) == tok.decode(ids[cut:])


def test_metaspace_leading_space(metaspace_tok):
    out = [3, 4, 5, 8, 7]  # "▁Hello ▁world ! ▁caf é"
    detok = IncrementalDetokenizer(metaspace_tok)
    assert "".join(stream(detok, out)) == metaspace_tok.decode(out) == "Hello world! café"
    # With the prompt as left context the first token keeps its leading space, as it reads after the prompt.
    prompt = [3]
    detok = IncrementalDetokenizer(metaspace_tok, prompt_ids=prompt)
    assert "".join(stream(detok, out)) == " Hello world! café"
    assert metaspace_tok.decode(prompt + out) == "Hello" + detok.text


def test_random_chunking_is_invariant(tok):
    rng = random.Random(0)
    ids = tok.encode("".join(TEXTS) + "<|im_end|>", add_special_tokens=False)
    ids += [rng.randrange(tok.vocab_size) for _ in range(300)]  # arbitrary tokens, incl. stray bytes
    for skip in (True, False):
        expected = tok.decode(ids, skip_special_tokens=skip)
        for _ in range(5):
            sizes = tuple(rng.randint(1, 7) for _ in range(20))
            assert "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, sizes)) == expected


# ---- stop strings ------------------------------------------------------------------------------


def run_stop(stops, chunks):
    m = StopStringMatcher(stops)
    out, result = [], None
    for c in chunks:
        result = m.feed(c)
        out.append(result.text)
        if result.stopped:
            break
    else:
        out.append(m.flush())
    return "".join(out), (result.stopped if result else False), (result.matched if result else None)


def test_stop_across_chunk_boundaries():
    assert run_stop(["STOP"], ["Hello ST", "O", "P and more"]) == ("Hello ", True, "STOP")
    assert run_stop(["\n\n"], ["line one\n", "\nline two"]) == ("line one", True, "\n\n")


def test_partial_prefix_held_back_then_released():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("text </ans") == StopResult("text ", False, None)
    assert m.feed("wer is not") == StopResult("</answer is not", False, None)
    assert m.feed(" <") == StopResult(" ", False, None)
    assert m.flush() == "<" and m.flush() == ""


def test_earliest_stop_wins_whatever_the_chunking():
    text = "say abcd then xyz"
    for stops in (["xyz", "bc", "abcd"], ["abcd", "bc"]):
        for n in (1, 2, 3, len(text)):
            chunks = [text[i : i + n] for i in range(0, len(text), n)]
            assert run_stop(stops, chunks) == ("say a", True, "bc")
    assert run_stop(["b", "abc"], ["xabc"])[2] == "b"
    assert run_stop(["abc", "bc"], ["xabc"]) == ("x", True, "abc")  # same end: the one starting first


def test_stop_at_very_start_and_after_stop():
    m = StopStringMatcher(["Hi"])
    assert m.feed("Hi there") == StopResult("", True, "Hi")
    assert m.feed("more") == StopResult("", True, "Hi") and m.flush() == ""
    assert run_stop(["<|"], ["<", "|x"]) == ("", True, "<|")


def test_no_stop_strings_passes_through_and_rejects_empty():
    assert run_stop([], ["a", "b"]) == ("ab", False, None)
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(["ok", ""])


def test_detokenizer_and_stop_matcher_pipeline(tok):
    ids = tok.encode("Answer: 42 😀\nUser: next question", add_special_tokens=False)
    detok, stop = IncrementalDetokenizer(tok), StopStringMatcher(["\nUser:", "😀😀"])
    emitted = []
    for i in ids:
        r = stop.feed(detok.step([i]))
        emitted.append(r.text)
        if r.stopped:
            break
    assert "".join(emitted) == "Answer: 42 😀" and stop.matched == "\nUser:"
