"""Incremental detokenizer with the real SmolLM2 tokenizer: deltas concatenate to tokenizer.decode, no
emitted text ever changes later (split UTF-8, stop strings), stop strings across token boundaries."""
import random

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import Logprob, decode_logprobs, decode_token
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本 mixed with English, ñandú, Ελληνικά, עברית.",
    "Emoji: 🌍🎉👩‍👩‍👧‍👦 🇫🇷 ✨ and 𝕄𝕒𝕥𝕙 𝔽𝕣𝕒𝕜𝕥𝕦𝕣",
    "<|im_start|>assistant\nSure! Here's code:\n```python\nprint('hi')\n```<|im_end|>",
    "   leading spaces\t\ttabs\n\nnewlines   trailing   ",
]


def stream(tok, ids, params, rng=None, finish=True):
    """Feed ids in random chunks; check that the emitted text only ever grows; return the deltas."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], params)
    rng = rng or random.Random(0)
    deltas, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 3)
        last = i + n >= len(ids)
        deltas.append(detok.update(ids[i:i + n], finished=finish and last))
        assert detok.output_text == "".join(deltas)
        i += n
    return detok, deltas


def random_ids(tok, rng):
    kind = rng.random()
    if kind < 0.4:    # real text, so multi-byte characters split over byte-level tokens
        ids = tok.encode(rng.choice(TEXTS))
        start = rng.randint(0, len(ids) - 1)
        return ids[start:start + rng.randint(1, 40)]
    if kind < 0.7:    # any ids, special tokens included
        return [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
    # lone UTF-8 bytes and specials: the decode has U+FFFD inside and at the end
    byte_tokens = tok.encode("ñ日🎉€") + [0, 1, 2]
    return [rng.choice(byte_tokens) for _ in range(rng.randint(1, 30))]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_decode_on_random_sequences(tok, skip_special_tokens):
    rng = random.Random(1234 + skip_special_tokens)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        ids = random_ids(tok, rng)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        detok, deltas = stream(tok, ids, params, rng)
        assert "".join(deltas) == full, ids
        assert detok.stop_reason is None and detok.token_ids == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_final_only_without_stop_strings_decodes_once_at_the_end(tok, skip_special_tokens):
    """A FINAL_ONLY request without stop strings (what LLM.generate sends) keeps its ids undecoded until it
    finishes, then decodes them in one call: tokenizer.decode's text. Read before the end (output_text), it
    settles the ids as the per-step path would have, and finishing after that gives the same text again."""
    rng = random.Random(77 + skip_special_tokens)
    final = SamplingParams(skip_special_tokens=skip_special_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    per_step = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(200):
        ids = random_ids(tok, rng)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tok, [], final)
        calls = []
        decode = detok._decode_fn
        detok._decode_fn = lambda x: calls.append(len(x)) or decode(x)
        i = 0
        while i + 3 < len(ids):
            assert detok.update(ids[i:i + 3]) == ""
            i += 3
        assert detok.update(ids[i:], finished=True) == full and detok.output_text == full
        assert calls == [len(ids)], calls                          # one decode of every id, at the end
        # read halfway: the same text as the per-step detokenizer holds there; the end is still the decode
        half = len(ids) // 2
        early, ref = IncrementalDetokenizer(tok, [], final), IncrementalDetokenizer(tok, [], per_step)
        early.update(ids[:half])
        ref.update(ids[:half])
        assert early.output_text == ref.output_text
        early.update(ids[half:], finished=True)
        assert early.output_text == full and early.token_ids == ids
    assert IncrementalDetokenizer(tok, [], SamplingParams(stop=["x"], output_kind=RequestOutputKind.FINAL_ONLY)
                                  )._deferred is False            # stop strings need the text every step


def test_split_characters_are_held_back_until_complete(tok):
    text = "🎉日本ñ"
    ids = tok.encode(text)
    assert len(ids) > 4     # several byte-level tokens per character
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    emitted = ""
    for token_id in ids:
        emitted += detok.update([token_id])
        assert "\ufffd" not in emitted and text.startswith(emitted)
    assert emitted == text


def test_unfinished_stream_holds_a_split_character_and_finish_releases_it(tok):
    ids = tok.encode("ab🎉")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.update(ids[:-1]) == "ab"
    assert "ab" + detok.update([], finished=True) == tok.decode(ids[:-1])    # ends in U+FFFD, like decode
    assert detok.output_text.endswith("\ufffd")


STOP_TEXT = "The answer is 42. Next question: why? The end."


@pytest.mark.parametrize("stop, include, expected", [
    (["question"], False, "The answer is 42. Next "),
    (["question"], True, "The answer is 42. Next question"),
    (["42. Ne"], False, "The answer is "),                  # spans several tokens
    (["why?", "is 4"], False, "The answer "),              # the earliest match wins, not the first listed
    (["T"], False, ""),                                     # at the very start
    (["nowhere"], False, STOP_TEXT),
])
def test_stop_strings(tok, stop, include, expected):
    ids = tok.encode(STOP_TEXT)
    for seed in range(5):
        detok, deltas = stream(tok, ids, SamplingParams(stop=stop, include_stop_str_in_output=include),
                               random.Random(seed))
        assert "".join(deltas) == expected
        assert detok.stop_reason == (None if expected == STOP_TEXT else
                                     min(stop, key=lambda s: STOP_TEXT.find(s) % 1000))


def test_stream_never_emits_text_a_stop_string_later_cuts(tok):
    rng = random.Random(7)
    for _ in range(200):
        ids = random_ids(tok, rng)
        full = tok.decode(ids, skip_special_tokens=True)
        if len(full) < 3:
            continue
        start = rng.randrange(len(full) - 1)
        stop = full[start:start + rng.randint(1, 4)]
        include = rng.random() < 0.5
        detok, deltas = stream(tok, ids, SamplingParams(stop=[stop, "\x00never"], include_stop_str_in_output=include), rng)
        index = full.find(stop)
        expected = full[:index + len(stop) if include else index]
        # the stream (asserted inside stream()) only grew; what it emitted is the truncated decode
        assert "".join(deltas) == expected and detok.stop_reason == stop, (ids, stop)


def test_hold_back_is_at_most_the_longest_stop_minus_one(tok):
    ids = tok.encode(STOP_TEXT)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xyzw", "ab"]))
    emitted = ""
    for i, token_id in enumerate(ids):
        emitted += detok.update([token_id])
        assert len(tok.decode(ids[:i + 1])) - len(emitted) <= 3
    assert emitted + detok.update([], finished=True) == STOP_TEXT


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("stop stop stop stop stop stop")
    detok, deltas = stream(tok, ids, SamplingParams(stop=["stop"], min_tokens=3), random.Random(0))
    text = "".join(deltas)
    assert detok.stop_reason == "stop" and text.startswith("stop") and not text.endswith("stop")
    assert text == tok.decode(ids)[:len(text)]


def test_detokenize_false_emits_nothing(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(detokenize=False))
    assert detok.update(tok.encode("hello"), finished=True) == "" and detok.token_ids == tok.encode("hello")


def test_decode_logprobs(tok):
    topk_ids, topk_lps = [5, 17, 99, 3], [-0.1, -1.5, -2.0, -2.5]
    got = decode_logprobs(tok, 99, -2.0, 3, topk_ids, topk_lps, num_logprobs=2)
    assert list(got) == [99, 5, 17]
    assert got[99] == Logprob(-2.0, 3, tok.decode([99]))
    assert got[5] == Logprob(-0.1, 1, tok.decode([5])) and got[17].rank == 2
    same = decode_logprobs(tok, 5, -0.1, 1, topk_ids, topk_lps, num_logprobs=3)
    assert list(same) == [5, 17, 99] and same[5].rank == 1
    bare = decode_logprobs(None, 7, -3.0, 9)
    assert bare == {7: Logprob(-3.0, 9, None)}
    assert decode_token(tok, 19556) == tok.decode([19556])


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_equals_tokenizer_decode(tok, skip):
    """The hot-path decoder (the Rust tokenizer called directly) returns exactly tokenizer.decode."""
    from jaxserve.engine.detokenizer import _plain_backend, fast_decoder
    assert _plain_backend(tok) is not None          # the SmolLM2 tokenizer takes the fast path
    decode = fast_decoder(tok, skip_special_tokens=skip)
    rng = random.Random(3)
    seqs = [random_ids(tok, rng) for _ in range(200)] + [list(range(0, 40)), [0], [1, 2, 3]]
    for ids in seqs:
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)


def test_fast_decoder_falls_back_for_other_tokenizers():
    from jaxserve.engine.detokenizer import fast_decoder

    class Plain:
        def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
            return f"{list(ids)}{skip_special_tokens}{spaces_between_special_tokens}"

    assert fast_decoder(Plain(), False, True)([1, 2]) == "[1, 2]FalseTrue"
