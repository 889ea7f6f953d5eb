"""Loading an EAGLE head (``models.eagle``): its Llama config.json checked against the target's, its
safetensors (or random weights of its config), the target's embedding and lm_head shared."""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import configs as model_configs, llama
from jaxserve.models.eagle import ARCHITECTURE, FAMILY
from jaxserve.models.hf_weights import load_weights
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.safetensors_loader import safetensors_getter


def head_config(hf: dict, target_cfg: ModelConfig, fc_bias: bool) -> ModelConfig:
    """The head's ``ModelConfig`` from its Llama config.json, refused where it cannot share the target's
    embedding and lm_head."""
    cfg = model_configs.model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
    for field in ("hidden_size", "vocab_size"):
        if getattr(cfg, field) != getattr(target_cfg, field):
            raise ModelLoadError(f"EAGLE head's {field} is {getattr(cfg, field)} and the target's "
                                 f"{getattr(target_cfg, field)}: the head must be trained for this target")
    llama.check_config(cfg)
    return dataclasses.replace(cfg, architecture=ARCHITECTURE, tie_word_embeddings=target_cfg.tie_word_embeddings,
                               extra=cfg.extra + (("fc_bias", bool(fc_bias)),))


def load_eagle_head(path: str, target: LoadedModel, *, load_format: str = "auto", seed: int = 0) -> LoadedModel:
    """The EAGLE head in the folder ``path`` (config.json and safetensors; ``load_format="dummy"``: random
    weights of its config), on the target's device and in its dtype, sharing its embedding and lm_head."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"EAGLE head {path!r}: not a folder (an EAGLE checkpoint's config.json and "
                             "safetensors)")
    hf = model_configs.read_json(os.path.join(path, "config.json"))
    dtype = target.dtype
    if load_format == "dummy":
        cfg = head_config(hf, target.config, hf.get("bias", False))
        params = FAMILY.init_dummy_params(cfg, dtype, seed=seed)
    else:
        get, file_of = safetensors_getter(path)
        cfg = head_config(hf, target.config, hf.get("bias", False) or get.has("fc.bias"))
        params = load_weights(cfg, FAMILY, get, dtype, file_of=file_of, desc="Loading the EAGLE head")
        params["layers"][0]["attn_norm"] = jnp.ones((cfg.hidden_size,), dtype)      # (not read)
    params["embed"] = target.params["embed"]
    if "lm_head" in target.params:
        params["lm_head"] = target.params["lm_head"]
    return LoadedModel(config=cfg, params=params, family=FAMILY, tokenizer=target.tokenizer,
                       chat_template=None, generation_config={}, source=path, dtype=dtype,
                       max_model_len=target.max_model_len, load_format="dummy" if load_format == "dummy"
                       else "safetensors")
