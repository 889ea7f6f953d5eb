"""``load_model``: which weight source a model name or path is, and that source's loader.

One loader per source, each ending in a ``LoadedModel`` (``loaded_model``): an HF folder's safetensors
(``safetensors_loader``), a GGUF file (``gguf_loader``), a converted orbax folder (``orbax_loader``) and random
weights for a shipped config or a folder's (``dummy_loader``). The safetensors and GGUF loaders build the
family's weight pytree through one plan on the device (``hf_weights``); the family comes from the registry.
"""
from __future__ import annotations

import os
from typing import Any

from jaxserve.config import LOAD_FORMATS
from jaxserve.errors import ModelLoadError
from jaxserve.models import packaged
from jaxserve.models.dummy_loader import dummy_config_names, is_dummy_config, load_dummy
from jaxserve.models.gguf_loader import load_gguf
from jaxserve.models.loaded_model import LoadedModel, float_only
from jaxserve.models.orbax_loader import is_orbax_checkpoint, load_orbax
from jaxserve.models.safetensors_loader import load_hf_folder



def model_path(model: str | None) -> str:
    """The file or folder ``model`` names: the embedded SmolLM2 GGUF (None), a packaged model's GGUF, or the
    (user-expanded) path itself."""
    if model is None:
        return packaged.embedded_model_path()
    if packaged.is_packaged_model(model):
        return packaged.packaged_gguf_path(model)
    return os.path.expanduser(model)


def load_model(model: str | None, *, dtype: str | Any = "auto", load_format: str = "auto",
               max_model_len: int | None = None, mesh=None, seed: int = 0,
               quantization: str | None = "auto", enable_expert_parallel: bool = False,
               hf_overrides: dict | None = None) -> LoadedModel:
    """Load a model: ``None`` (the embedded SmolLM2 GGUF), a packaged model's name (``gemma3-270m``), a
    ``.gguf`` file, an HF folder, or the name of a ``configs/models/*.json`` (random weights).
    ``load_format="dummy"`` gives random weights for any of them.
    ``quantization`` (vLLM's ``--quantization``): ``auto`` follows an HF checkpoint's ``quantization_config``;
    random weights take any method's storage (int4 groups of 128 for awq / gptq / compressed-tensors).
    ``enable_expert_parallel``: a mixture-of-experts model's experts sharded over the mesh (``layers.moe``;
    HF folders, GGUF files and dummy configs). ``hf_overrides``: vLLM's ``--hf-overrides``, keys of the model's
    HF config replaced before it is read (HF folders, GGUF files, dummy configs).
    """
    quantization = quantization or "auto"
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format {load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}")
    path = model_path(model)
    ep = {"enable_expert_parallel": True} if enable_expert_parallel else {}
    if hf_overrides:
        ep["hf_overrides"] = dict(hf_overrides)
    if load_format == "orbax" or (load_format == "auto" and is_orbax_checkpoint(path)):
        float_only(quantization, f"{path} is an orbax checkpoint (float weights)")
        if ep:
            raise ModelLoadError(f"--{next(iter(ep)).replace('_', '-')} needs an HF folder or a configs/models "
                                 "name (not orbax)")
        return load_orbax(path, dtype=dtype, max_model_len=max_model_len, mesh=mesh)
    if os.path.isfile(path) and path.endswith(".gguf"):
        if load_format not in ("auto", "gguf"):
            raise ModelLoadError(f"{path} is a GGUF file; load_format {load_format!r} does not apply")
        return load_gguf(path, dtype=dtype, max_model_len=max_model_len, mesh=mesh, quantization=quantization, **ep)
    if os.path.isdir(path):
        if load_format == "gguf":
            raise ModelLoadError(f"{path} is a folder; pass the .gguf file itself for load_format gguf")
        return load_hf_folder(path, dtype=dtype, max_model_len=max_model_len, mesh=mesh,
                              dummy=load_format == "dummy", seed=seed, quantization=quantization, **ep)
    if is_dummy_config(str(model)) and load_format in ("auto", "dummy"):
        return load_dummy(str(model), dtype=dtype, max_model_len=max_model_len, mesh=mesh, seed=seed,
                          quantization=quantization, **ep)
    raise ModelLoadError(f"{model}: no such .gguf file, model folder or configs/models name "
                         f"(dummy configs: {', '.join(dummy_config_names())})")
