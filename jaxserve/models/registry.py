"""Model registry: HF ``architectures`` name → its family.

A decoder family's module (``llama.py``, ``gemma.py``, ...) defines ``FAMILY``, a ``layers.decoder.DecoderFamily``
(the functions the loaders and the step call); an encoder family's module (``bert``) is its own record and
exposes ``load(path, dtype) -> LoadedModel``. Modules are imported on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from jaxserve.errors import ModelLoadError

DECODER_ARCHITECTURES = {
    "LlamaForCausalLM": "jaxserve.models.llama",
    "MistralForCausalLM": "jaxserve.models.llama",
    "Qwen2ForCausalLM": "jaxserve.models.llama",
    "Qwen3ForCausalLM": "jaxserve.models.qwen3",
    "Gemma2ForCausalLM": "jaxserve.models.gemma",
    "Gemma3ForCausalLM": "jaxserve.models.gemma",
    "Gemma3ForConditionalGeneration": "jaxserve.models.gemma",   # its text model (text-only requests)
    "Phi3ForCausalLM": "jaxserve.models.phi3",
    "CohereForCausalLM": "jaxserve.models.cohere",
    "MixtralForCausalLM": "jaxserve.models.mixtral",
    "Qwen2MoeForCausalLM": "jaxserve.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "jaxserve.models.qwen3_moe",
}
ENCODER_ARCHITECTURES = {
    "BertModel": "jaxserve.models.bert",
    "BertForMaskedLM": "jaxserve.models.bert",
    "BertForSequenceClassification": "jaxserve.models.bert",
    "BertForPreTraining": "jaxserve.models.bert",
}
SUPPORTED_ARCHITECTURES = tuple(DECODER_ARCHITECTURES) + tuple(ENCODER_ARCHITECTURES)


def is_encoder(architecture: str) -> bool:
    return architecture in ENCODER_ARCHITECTURES


def resolve_architecture(architectures: list[str] | tuple[str, ...] | str | None) -> tuple[str, Any]:
    """The first supported name of ``architectures`` and its family (a decoder's ``DecoderFamily``, an
    encoder's module), or a ModelLoadError naming the supported ones."""
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        module_name = DECODER_ARCHITECTURES.get(name) or ENCODER_ARCHITECTURES.get(name)
        if module_name is None:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            raise ModelLoadError(f"architecture {name} needs {module_name}, which is not available "
                                 f"in this build") from None
        return name, getattr(module, "FAMILY", module)
    raise ModelLoadError(f"unsupported model architecture {names or '(none given)'}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
