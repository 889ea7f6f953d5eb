"""Random weights: for a shipped config (``configs/models/NAME.json``, public HF config.json values) or an HF
folder's config, in float or in any quantization method's storage, each weight made on the device(s) where it
lives (``DecoderFamily.init_dummy_params``). The tokenizer is the embedded SmolLM2 one."""
from __future__ import annotations

import jax.numpy as jnp

from jaxserve.errors import ModelLoadError
from jaxserve.models import configs as model_configs
from jaxserve.models import packaged, registry
from jaxserve.models.hf_weights import tree_get
from jaxserve.models.layers.moe import with_expert_parallel
from jaxserve.models.loaded_model import (LoadedModel, config_dtype, generation_config, resolve_dtype,
                                          resolve_max_model_len, with_fused_qkv)
from jaxserve.models.tokenizers import embedded_tokenizer, with_tokenizer
from jaxserve.quantization import config as quant_config
from jaxserve.quantization import loading as quant_loading


def dummy_config_names() -> list[str]:
    return sorted(p.stem for p in packaged.DUMMY_CONFIG_DIR.glob("*.json"))


def is_dummy_config(name: str) -> bool:
    return (packaged.DUMMY_CONFIG_DIR / f"{name}.json").is_file()


def load_dummy(name: str, *, dtype="auto", max_model_len=None, mesh=None, seed: int = 0,
               quantization: str | None = "auto", enable_expert_parallel: bool = False,
               hf_overrides: dict | None = None) -> LoadedModel:
    """Random weights for ``configs/models/NAME.json`` (with ``hf_overrides`` applied); the tokenizer is the
    embedded SmolLM2 one, since no model files exist (token ids beyond its vocab are never produced by it)."""
    hf = model_configs.with_hf_overrides(model_configs.read_json(str(packaged.DUMMY_CONFIG_DIR / f"{name}.json")),
                                         hf_overrides)
    cfg = with_expert_parallel(model_configs.model_config_from_hf(hf), enable_expert_parallel)
    _, family = registry.resolve_architecture(hf.get("architectures"))
    family.check_config(cfg)
    jdtype = resolve_dtype(dtype, config_dtype(hf, jnp.bfloat16))
    quant = dummy_quantization(quantization)
    cfg = with_fused_qkv(cfg, family, quant, mesh)
    params, tokenizer = with_tokenizer(embedded_tokenizer,
                                       lambda: dummy_params(cfg, family, jdtype, seed, mesh, quant))
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None),
                       generation_config=generation_config(cfg), source=f"dummy:{name}", dtype=jdtype,
                       max_model_len=resolve_max_model_len(cfg, max_model_len), load_format="dummy",
                       quantization=quant.method if quant is not None else None)


def dummy_quantization(quantization: str | None):
    """Random weights in ``quantization``'s storage (None: float)."""
    method = quant_config.canonical_method(quantization)
    if method in (None, "auto", "none"):
        return None
    if method not in quant_config.QUANTIZATION_METHODS:
        raise ModelLoadError(f"quantization {method!r} is not supported; choose one of "
                             f"{', '.join(quant_config.QUANTIZATION_METHODS)}")
    return quant_config.checkpoint_quantization(method)


def dummy_params(cfg, family, dtype, seed, mesh, quant) -> dict:
    """Random weights; with ``quant``, each projection quantized as soon as it is made, so the float weights
    never exist at once (a 70B model's bf16 weights are more than one GPU holds; its fp8 ones are not)."""
    if quant is None:
        return family.init_dummy_params(cfg, dtype, seed=seed, mesh=mesh)
    shardings = None
    if mesh is not None:
        from jaxserve.parallel import param_shardings  # noqa: PLC0415
        shardings = param_shardings(family.param_partition_specs(cfg), mesh, cfg)

    def quantize(path, w):
        if not quant_loading.is_linear(path):
            return w
        sharding = tree_get(shardings, path) if shardings is not None else None
        return quant_loading.quantize_leaf(quant, path, w, sharding, dtype)

    return family.init_dummy_params(cfg, dtype, seed=seed, mesh=mesh, transform=quantize)
