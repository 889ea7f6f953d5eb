"""Model families, the family registry and the weight loaders.

``load_model`` / ``LoadedModel`` are imported lazily so ``import jaxserve.models.<family>`` stays light.

Adding a decoder family: write ``jaxserve/models/<family>.py`` holding everything about it — its docstring
(how it differs from Llama), ``check_config`` (the configs it would get wrong), ``decoder_spec(cfg) ->
DecoderSpec`` (the shared decoder's switches; a new computation is a new generic ``DecoderSpec`` field in
``layers/``), its checkpoint names (``llama.LAYER_NAMES`` plus what differs), ``read_hf`` (its config.json
quirks, defaults and ``ModelConfig.extra``; ``config_fields.family_extra`` helps) and, if llama.cpp converts
it, a ``GGUFArch`` per GGUF architecture (metadata → HF config, extra tensor renames, value fixes) — and end it
with ``FAMILY = DecoderFamily(...)`` naming its ``architectures`` and ``model_types``. Then add it to
``registry.decoder_families`` and give it tests (a tiny HF fixture under tests/fixtures/models/ with HF's
logits, and a GGUF written as llama.cpp's converter writes one). Nothing else changes: the config reader, the
loaders and the decoder ask the family.
"""
from __future__ import annotations

__all__ = ["LoadedModel", "load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from jaxserve.models.loader import load_model
        return load_model
    if name == "LoadedModel":
        from jaxserve.models.loaded_model import LoadedModel
        return LoadedModel
    raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
