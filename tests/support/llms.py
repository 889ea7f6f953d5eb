"""The offline ``LLM`` a test module's ``llm`` fixture (tests/conftest.py) builds from the module's ``LLM_ARGS``."""
from __future__ import annotations

import pytest

from support.tiny_models import tiny_llm


def packaged_model_or_skip(name: str) -> str:
    """A packaged GGUF's path (``jaxserve.models.packaged``); skips the test where its package is not installed."""
    from jaxserve.errors import ModelLoadError
    from jaxserve.models import packaged
    try:
        return packaged.packaged_gguf_path(name)
    except ModelLoadError as e:
        pytest.skip(str(e))


def module_llm(args: dict | None):
    """``LLM_ARGS`` without a ``model``: ``tiny_llm(**args)`` (tiny Llama 3, the test defaults). With one:
    ``LLM(model, **rest)``, where ``model`` is a path, None (the embedded SmolLM2) or a function returning a path
    (which may skip)."""
    args = dict(args or {})
    if "model" not in args:
        return tiny_llm(**args)
    from jaxserve import LLM
    model = args.pop("model")
    return LLM(model() if callable(model) else model, **args)
