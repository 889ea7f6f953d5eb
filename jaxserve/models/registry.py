"""The model families, and which one serves a model.

Each family declares what it serves. A decoder family's module (``llama.py``, ``gemma.py``, ...) defines
``FAMILY``, a ``layers.decoder.DecoderFamily`` that lists its HF ``architectures``, the ``model_types`` of its
configs and its GGUF architectures (``gguf``); an encoder family's module (``bert``) is its own record, with
``architectures`` and ``load(path, dtype) -> LoadedEncoder``. The registry lists the families (in the order
their names appear in messages) and imports them on first use.
"""
from __future__ import annotations

import functools
from typing import Any

from jaxserve.errors import ModelLoadError


@functools.cache
def decoder_families() -> tuple[Any, ...]:
    """Every decoder family's ``DecoderFamily``."""
    from jaxserve.models import (cohere, deepseek, eagle, eagle3, gemma, gemma3_vision, llama,  # noqa: PLC0415
                                 llava, llava_next, mixtral, mllama, phi3, qwen2_moe, qwen2_vl, qwen3, qwen3_moe)

    return (llama.FAMILY, gemma.FAMILY, qwen3.FAMILY, phi3.FAMILY, cohere.FAMILY, mixtral.FAMILY,
            qwen2_moe.FAMILY, qwen3_moe.FAMILY, deepseek.FAMILY, llava.FAMILY, llava_next.FAMILY,
            qwen2_vl.FAMILY, gemma3_vision.FAMILY, mllama.FAMILY, eagle.FAMILY, eagle.MTP_FAMILY, eagle3.FAMILY)


@functools.cache
def encoder_families() -> tuple[Any, ...]:
    """Every encoder family's module (imported apart: telling an encoder model needs no decoder layers)."""
    from jaxserve.models import bert  # noqa: PLC0415

    return (bert,)


@functools.cache
def _architectures(encoders: bool) -> dict[str, Any]:
    return {arch: family for family in (encoder_families() if encoders else decoder_families())
            for arch in family.architectures}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_architectures(False)) + tuple(_architectures(True))


def is_encoder(architecture: str) -> bool:
    return architecture in _architectures(True)


def resolve_architecture(architectures: list[str] | tuple[str, ...] | str | None) -> tuple[str, Any]:
    """The first supported name of ``architectures`` and its family (a decoder's ``DecoderFamily``, an
    encoder's module), or a ModelLoadError naming the supported ones."""
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        family = _architectures(True).get(name) or _architectures(False).get(name)
        if family is not None:
            return name, family
    raise ModelLoadError(f"unsupported model architecture {names or '(none given)'}; supported: "
                         f"{', '.join(supported_architectures())}")


@functools.cache
def _by_model_type() -> dict[str, Any]:
    return {model_type: family for family in decoder_families() for model_type in family.model_types}


def family_of_model_type(model_type: str | None) -> Any | None:
    """The decoder family whose configs have this HF ``model_type``, or None."""
    return _by_model_type().get(model_type)


@functools.cache
def _gguf() -> dict[str, Any]:
    return {arch: spec for family in decoder_families() for arch, spec in family.gguf.items()}


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF ``general.architecture`` values some family reads."""
    return tuple(_gguf())


def gguf_architecture(arch: str | None):
    """How a family reads GGUF files of ``general.architecture`` ``arch`` (``gguf_config.GGUFArch``), or None."""
    return _gguf().get(arch)
