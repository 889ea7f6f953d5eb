"""GGUF tokenizers built from the file's own vocabulary (jaxserve/models/gguf_tokenizer.py).

Oracles: for SentencePiece vocabularies (Gemma 3) the ``sentencepiece`` library itself, loaded with a model
proto made from the same GGUF vocabulary (an independent implementation of SentencePiece BPE with byte
fallback), plus the ids known from the model ("The capital of Japan is"); for SmolLM2's byte-level BPE the
tokenizer.json shipped under configs/tokenizers/smollm2.
"""
import os

import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models import gguf_tokenizer as gt
from jaxserve.models import packaged, tokenizers
from jaxserve.models.gguf_file import GGUFFile

SMOLLM2_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tokenizers", "smollm2")

CORPUS = [
    "Hello, world!",
    "The capital of Japan is",
    " leading space, and trailing ones   ",
    "two  spaces, three   and a run of forty:" + " " * 40 + "end",
    "tabs\tand\t\ttabs, newlines\nand\n\n\nmore\r\nwindows",
    "unicode: naïve café, Straße, 東京都, Москва, مرحبا, हिन्दी, ελληνικά",
    "emoji 😀🤖👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇯🇵",
    "def square(x):\n    return x ** 2  # a comment\n\n\tif x:\n\t\tpass\n",
    "numbers 1234567890 3.14159 -42 1e-9 ٣٤٥ ½ ²",
    "punctuation!!! ??? ... ;;; 'single' \"double\" `back` «guillemets» — dash",
    "<div>html</div> <table><tr><td>cell</td></tr></table> <b>bold</b>",
    "don't won't I'm you're they've we'll he'd",
    "a" * 64,
    "\u00a0no-break\u200bzero-width\u2028line-sep\ufeffbom",
    "combining e\u0301 and precomposed é, Hangul 한국어",
    "rare symbols ✈︎ ⌘ ∮ 𝔸 \U0001F9EC \U0010FFFD",
    "mixedCASE camelCase snake_case kebab-case SCREAMING",
    "https://example.com/path?q=1&x=y#frag user@example.org",
    '{"a": [1, 2, {"b": null}], "c": "d"}',
    "",
]


def _gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return tokenizers.gguf_tokenizer(gemma3_path)


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return packaged.embedded_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def sentencepiece_from_vocab(vocab: gt.GGUFVocab):
    """A ``sentencepiece`` processor for a GGUF SentencePiece vocabulary: BPE, byte fallback, spaces
    escaped as ``▁``, no other normalization. User-defined pieces get their ``▁`` back (llama.cpp's
    converter stores them with plain spaces; SentencePiece matches them after escaping)."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = vocab.add_space_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    kinds = {gt.NORMAL: pb.ModelProto.SentencePiece.NORMAL, gt.CONTROL: pb.ModelProto.SentencePiece.CONTROL,
             gt.USER_DEFINED: pb.ModelProto.SentencePiece.USER_DEFINED, gt.BYTE: pb.ModelProto.SentencePiece.BYTE,
             gt.UNUSED: pb.ModelProto.SentencePiece.UNUSED, gt.UNKNOWN: pb.ModelProto.SentencePiece.UNKNOWN}
    for i, (token, kind, score) in enumerate(zip(vocab.tokens, vocab.types, vocab.scores)):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "▁") if kind == gt.USER_DEFINED else token
        piece.score = score
        piece.type = pb.ModelProto.SentencePiece.UNKNOWN if i == vocab.unk_id else kinds[kind]
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


# ------------------------------------------------------------------------------------------ Gemma 3
def test_gemma3_known_prompt(gemma3):
    ids = gemma3.encode("The capital of Japan is")
    assert ids == [2, 818, 5279, 529, 6056, 563]
    assert gemma3.convert_ids_to_tokens(ids)[2] == "▁capital"
    assert gemma3.decode(ids, skip_special_tokens=True) == "The capital of Japan is"


def test_gemma3_matches_sentencepiece(gemma3, gemma3_path):
    vocab = gt.read_gguf_vocab(_gguf(gemma3_path).fields)
    sp = sentencepiece_from_vocab(vocab)
    for text in CORPUS:
        assert gemma3.encode(text, add_special_tokens=False) == sp.encode(text), text


def test_gemma3_special_tokens_and_round_trip(gemma3):
    assert (gemma3.bos_token, gemma3.bos_token_id) == ("<bos>", 2)
    assert (gemma3.eos_token, gemma3.eos_token_id) == ("<eos>", 1)
    assert (gemma3.pad_token_id, gemma3.unk_token_id) == (0, 3)
    chat = "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma3.encode(chat)
    assert ids[:3] == [2, 105, 2364] and 106 in ids          # <bos>, <start_of_turn>, "user"
    assert gemma3.decode(ids) == "<bos>" + chat
    assert gemma3.decode(ids, skip_special_tokens=True) == chat.replace("<start_of_turn>", "").replace(
        "<end_of_turn>", "")
    for text in CORPUS:
        assert gemma3.decode(gemma3.encode(text), skip_special_tokens=True) == text, text
    # an unknown character falls back to its UTF-8 bytes and decodes back whole
    ids = gemma3.encode("\U0010FFFD", add_special_tokens=False)
    assert gemma3.convert_ids_to_tokens(ids)[-4:] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]


def test_gemma3_differs_from_unigram_conversion(gemma3):
    """The score-ranked BPE merges give one piece where a Unigram reading of the scores splits the word
    (transformers' GGUF conversion: c|ap|it|al)."""
    assert gemma3.tokenize("The capital") == ["The", "▁capital"]


# ------------------------------------------------------------------------------------------ SmolLM2
def test_smollm2_matches_shipped_tokenizer_json(smollm2_path):
    """Identical ids to configs/tokenizers/smollm2 (written by transformers' GGUF conversion), except for
    numerals outside ASCII: the GGUF's pre-tokenizer ``smollm`` isolates every \\p{N} character, as the
    original SmolLM2 tokenizer does (Digits(individual_digits) before ByteLevel), and the shipped file lacks
    that step; with it put back, the two agree on everything."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    ours = tokenizers.gguf_tokenizer(smollm2_path)
    shipped = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    original = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    original.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    specials = "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nhi<|endoftext|>"
    for text in CORPUS + [specials]:
        ids = ours.encode(text)
        assert ids == original.encode(text), text
        if not any(c.isnumeric() and not c.isascii() for c in text):
            assert ids == shipped.encode(text), text
        assert ours.decode(ids) == text, text
    assert ours.tokenize(" ½") == ["Ġ", "Â½"] and shipped.tokenize(" ½") == ["ĠÂ", "½"]
    assert ours.decode(ours.encode(specials), skip_special_tokens=True) == "system\nYou are helpful\nuser\nhi"


def test_smollm2_metadata(smollm2_path):
    tok = tokenizers.gguf_tokenizer(smollm2_path)
    fields = _gguf(smollm2_path).fields
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.unk_token == "<|endoftext|>"
    assert tok.encode("hi")[0] != tok.bos_token_id          # add_bos_token false
    assert tok.chat_template == fields["tokenizer.chat_template"]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------------- small vocabularies
def _tiny_spm_fields(add_space_prefix: bool) -> dict:
    """A small SentencePiece BPE vocabulary: specials, the 256 byte tokens, characters and merges."""
    normal = ["▁", "a", "b", "c", "d", "▁a", "ab", "bc", "▁ab", "abc", "▁abc", "cd", "▁c", "▁d", "dd"]
    tokens = ["<unk>", "<s>", "</s>", "<ctrl>", "xx"] + [f"<0x{i:02X}>" for i in range(256)] + normal
    types = [gt.UNKNOWN, gt.CONTROL, gt.CONTROL, gt.CONTROL, gt.USER_DEFINED] + [gt.BYTE] * 256 \
        + [gt.NORMAL] * len(normal)
    scores = [0.0] * (5 + 256) + [-float(i) for i in range(len(normal))]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_space_prefix}


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_tiny_spm_matches_sentencepiece(add_space_prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    fields = _tiny_spm_fields(add_space_prefix)
    tok = gt.tokenizer_from_gguf(fields)
    sp = sentencepiece_from_vocab(gt.read_gguf_vocab(fields))
    for text in ["abc", "abcd abc", " ab  c", "dddd", "abé", "a\nb", "cabbage", "abc xx", ""]:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text, text
    assert tok.encode("abc")[0] == 1                       # add_bos_token defaults to true for SentencePiece
    # llama.cpp prepends the space prefix to the text after every token it splits out (control or
    # user-defined); SentencePiece, which knows no control tokens in text, only at the start
    for text, prefixed, plain in [("abc<ctrl>abc", ["▁abc", "<ctrl>", "▁abc"], ["abc", "<ctrl>", "abc"]),
                                  ("xx abc", ["xx", "▁", "▁abc"], ["xx", "▁abc"])]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids) == (prefixed if add_space_prefix else plain), text


def test_unsupported_vocabularies_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    fields = _tiny_spm_fields(False)
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert' is not supported"):
        gt.tokenizer_from_gguf({**fields, "tokenizer.ggml.model": "bert"})
    bpe = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
           "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "tekken"}
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'tekken'.*not supported"):
        gt.tokenizer_from_gguf(bpe)
    with pytest.raises(ModelLoadError, match="no tokenizer.ggml.merges"):
        gt.tokenizer_from_gguf({**bpe, "tokenizer.ggml.merges": []})
    assert gt.tokenizer_from_gguf({**bpe, "tokenizer.ggml.pre": "gpt-2"}).encode("ab") == [2]


def test_tokenizer_json_is_cached_per_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    vocab = gt.read_gguf_vocab(_tiny_spm_fields(False))
    first = gt.tokenizer_json(vocab)
    assert first.startswith(str(tmp_path)) and gt.tokenizer_json(vocab) == first
    other = gt.read_gguf_vocab(_tiny_spm_fields(True))
    assert gt.tokenizer_json(other) != first


def test_gguf_file_reads_what_gguf_reader_reads(smollm2_path):
    """GGUFFile (one struct pass over the header) gives GGUFReader's metadata values and tensor views."""
    import gguf
    import numpy as np

    ours, theirs = _gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        value = ours.fields[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
    for a, b in zip(ours.tensors[:3], theirs.tensors[:3]):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_llguidance_reads_gguf_tokenizers(gemma3, smollm2_path):
    """Structured outputs read the tokenizer.json form: llguidance tokenizes and decodes as we do."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    text = "The capital of Japan is Tokyo.\n  東京 😀 {\"a\": 1}"
    for tok in (gemma3, tokenizers.gguf_tokenizer(smollm2_path)):
        ll = llguidance.hf.from_tokenizer(tok)
        ids = tok.encode(text, add_special_tokens=False)
        assert ll.tokenize_str(text) == ids and ll.decode_str(ids) == text
        assert ll.eos_token == tok.eos_token_id
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        assert not llguidance.LLMatcher(ll, grammar).is_error()
