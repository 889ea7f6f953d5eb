"""HF fast tokenizers built from a GGUF file's own vocabulary, read the way llama.cpp reads it.

A GGUF file carries its tokenizer as metadata: ``tokenizer.ggml.tokens`` / ``scores`` / ``token_type``
(+ ``merges`` for byte-level BPE), the special ids, ``add_bos_token`` / ``add_eos_token`` and the chat
template. This module turns that into a ``tokenizers.Tokenizer`` wrapped in a
``transformers.PreTrainedTokenizerFast``, so chat templates, the detokenizer and llguidance (which reads the
``tokenizer.json`` form) use it like any HF tokenizer.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma). llama.cpp's SPM tokenizer
  starts from the characters of the text (spaces escaped as ``▁``) and repeatedly merges the adjacent pair
  whose concatenation is a token with the highest score (ties: leftmost); a final piece that is not a token
  becomes its UTF-8 byte tokens ``<0xXX>``. That is a BPE whose merge ranks are the merged token's score:
  every split ``(left, right)`` of a normal token into two normal tokens is a merge, ranked by the merged
  token's score. (transformers' GGUF conversion builds a Unigram model from these scores instead, which
  segments differently: Gemma 3's "capital" became ``c|ap|it|al``, not ``▁capital``.)
- ``gpt2``: byte-level BPE with the file's merges and the pre-tokenizer regexes llama.cpp uses for
  ``tokenizer.ggml.pre``.

Token types (``gguf.TokenType``): control and unknown tokens are special added tokens (parsed from text,
skipped by ``skip_special_tokens``); user-defined tokens are non-special added tokens matched on the raw
text before anything else (llama.cpp splits them out first; its converter stores them with plain spaces).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
from typing import Any

from jaxserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# gguf.TokenType values (spelled out: the enum import is only needed to read the file)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) by ``tokenizer.ggml.pre``, applied in order, each
# splitting every piece into its matches and the text between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2,) for name in ("gpt-2", "mpt", "olmo", "jais")},
    **{name: (r"\p{N}", _GPT2) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                             "exaone", "minerva")},
    **{name: (_LLAMA3,) for name in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3")},
    **{name: (_QWEN2,) for name in ("qwen2", "stablelm2", "deepseek-r1-qwen")},
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"[0-9][0-9][0-9]"),
}


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of a GGUF file (llama.cpp's key names, defaults as llama.cpp applies them)."""
    model: str                              # tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2"
    pre: str | None                         # tokenizer.ggml.pre (gpt2 only)
    tokens: list[str]
    scores: list[float] | None
    types: list[int]
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    max_length: int | None


def read_gguf_vocab(fields: dict[str, Any]) -> GGUFVocab:
    """The ``GGUFVocab`` of a GGUF file's metadata (``GGUFFile.fields``)."""

    def get(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    model = get("tokenizer.ggml.model")
    if model not in ("llama", "gpt2"):
        raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported; supported: llama "
                             f"(SentencePiece), gpt2 (byte-level BPE)")
    tokens = get("tokenizer.ggml.tokens")
    if tokens is None or not len(tokens):
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens vocabulary")
    types = get("tokenizer.ggml.token_type")
    types = [NORMAL] * len(tokens) if types is None else types
    scores = get("tokenizer.ggml.scores")
    if model == "llama" and scores is None:
        raise ModelLoadError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
    merges = get("tokenizer.ggml.merges")
    if model == "gpt2" and (merges is None or not len(merges)):
        raise ModelLoadError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    arch = get("general.architecture")
    spm = model == "llama"

    def token_id(key: str) -> int | None:
        value = get(f"tokenizer.ggml.{key}_token_id")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    return GGUFVocab(
        model=model, pre=get("tokenizer.ggml.pre"), tokens=list(tokens),
        scores=[float(s) for s in scores] if scores is not None else None,
        types=[int(t) for t in types], merges=list(merges) if merges is not None else None,
        bos_id=token_id("bos"), eos_id=token_id("eos"), unk_id=token_id("unknown"),
        pad_id=token_id("padding"),
        # llama.cpp's defaults when a key is absent: SentencePiece adds <bos> and a space prefix, BPE neither
        add_bos=bool(get("tokenizer.ggml.add_bos_token", spm)),
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", spm)),
        chat_template=get("tokenizer.chat_template"),
        max_length=get(f"{arch}.context_length") if arch else None,
    )


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """The BPE merges equivalent to SentencePiece's score-ordered merging: every split of a normal token
    into two normal tokens, ranked by the merged token's score (higher first; ties by id, as llama.cpp's
    queue breaks them by position and the ids of a BPE-trained vocabulary follow its scores)."""
    normal = {t: i for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.types)) if ty == NORMAL}
    ranked = sorted(normal.values(), key=lambda i: (-vocab.scores[i], i))
    merges = []
    for i in ranked:
        piece = vocab.tokens[i]
        merges += [(piece[:k], piece[k:]) for k in range(1, len(piece))
                   if piece[:k] in normal and piece[k:] in normal]
    return merges


def _added_tokens(vocab: GGUFVocab):
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(vocab.tokens, vocab.types) if ty in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(vocab.tokens, vocab.types) if ty == USER_DEFINED]
    return special, user


def _post_processor(vocab: GGUFVocab):
    from tokenizers import processors

    ends = []
    if vocab.add_bos and vocab.bos_id is not None:
        ends.append(("bos", vocab.tokens[vocab.bos_id], vocab.bos_id))
    if vocab.add_eos and vocab.eos_id is not None:
        ends.append(("eos", vocab.tokens[vocab.eos_id], vocab.eos_id))
    if not ends:
        return None
    bos = [f"{t}:0" for kind, t, _ in ends if kind == "bos"]
    eos = [f"{t}:0" for kind, t, _ in ends if kind == "eos"]
    return processors.TemplateProcessing(
        single=" ".join(bos + ["$A:0"] + eos),
        pair=" ".join(bos + ["$A:0"] + eos + bos + ["$B:1"] + eos),
        special_tokens=sorted({(t, i) for _, t, i in ends}, key=lambda x: x[1]))


def _spm_tokenizer(vocab: GGUFVocab):
    from tokenizers import Tokenizer, decoders, models, normalizers

    byte_fallback = any(ty == BYTE for ty in vocab.types)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=spm_merges(vocab),
                               unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    escape = normalizers.Replace(" ", "▁")
    # llama.cpp prepends the space to every stretch of text that starts the input or follows a token it
    # split out (control or user-defined): the normalizer runs once per such stretch here too
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), escape]) if vocab.add_space_prefix
                      else escape)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _bpe_tokenizer(vocab: GGUFVocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = vocab.pre or "default"
    if pre not in BPE_PRE_TOKENIZERS:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
                             f"{', '.join(sorted(BPE_PRE_TOKENIZERS))}")
    merges = []
    for m in vocab.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"GGUF merge {m!r} is not two tokens separated by a space")
        merges.append((left, right))
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=merges,
                               unk_token=unk, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in BPE_PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(vocab: GGUFVocab):
    """The ``tokenizers.Tokenizer`` for a ``GGUFVocab``."""
    tok = _spm_tokenizer(vocab) if vocab.model == "llama" else _bpe_tokenizer(vocab)
    special, user = _added_tokens(vocab)
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    post = _post_processor(vocab)
    if post is not None:
        tok.post_processor = post
    return tok


# bump when build_tokenizer changes what it builds: cached tokenizer.json files of older builds are ignored
BUILD_VERSION = 1


def _vocab_key(vocab: GGUFVocab) -> str:
    import tokenizers

    h = hashlib.sha256(f"{BUILD_VERSION} {tokenizers.__version__} {vocab.model} {vocab.pre} {vocab.bos_id} "
                       f"{vocab.eos_id} {vocab.unk_id} {vocab.add_bos} {vocab.add_eos} "
                       f"{vocab.add_space_prefix}".encode())
    h.update("\0".join(vocab.tokens).encode())
    h.update(bytes(str(vocab.types), "ascii"))
    h.update(repr(vocab.scores).encode())
    h.update("\n".join(vocab.merges or []).encode())
    return h.hexdigest()[:32]


def tokenizer_json(vocab: GGUFVocab) -> str:
    """Path of ``build_tokenizer(vocab)`` saved as a ``tokenizer.json``, built once per vocabulary into
    jaxserve's cache (building Gemma 3's 262k tokens and 514k merges takes seconds; loading the file is
    quicker), or into a temporary folder where the cache is not writable."""
    from jaxserve.models.packaged import cache_dir

    target = cache_dir() / "tokenizers" / _vocab_key(vocab) / "tokenizer.json"
    if target.is_file():
        return str(target)
    tok = build_tokenizer(vocab)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"tokenizer.{os.getpid()}.partial")
        tok.save(str(partial))
        os.replace(partial, target)
        return str(target)
    except OSError as e:
        logger.warning("cannot cache the GGUF tokenizer in %s (%s); building it in a temporary folder",
                       target.parent, e)
        path = os.path.join(tempfile.mkdtemp(prefix="jaxserve-tokenizer-"), "tokenizer.json")
        tok.save(path)
        return path


def hf_tokenizer(vocab: GGUFVocab):
    """``build_tokenizer(vocab)`` as a ``transformers.PreTrainedTokenizerFast`` with the file's special
    tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    def name(i: int | None) -> str | None:
        return vocab.tokens[i] if i is not None else None

    extra = {"model_max_length": int(vocab.max_length)} if vocab.max_length else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_json(vocab), bos_token=name(vocab.bos_id), eos_token=name(vocab.eos_id),
        unk_token=name(vocab.unk_id), pad_token=name(vocab.pad_id), chat_template=vocab.chat_template,
        clean_up_tokenization_spaces=False, **extra)     # decode gives back the text's own spacing
    # transformers may rebuild the post-processor from its own add_bos/add_eos flags: keep the file's
    post = _post_processor(vocab)
    if post is not None:
        fast.backend_tokenizer.post_processor = post
    return fast


def tokenizer_from_gguf(fields: dict[str, Any]):
    """The HF fast tokenizer of a GGUF file's metadata (``GGUFFile.fields``)."""
    return hf_tokenizer(read_gguf_vocab(fields))
