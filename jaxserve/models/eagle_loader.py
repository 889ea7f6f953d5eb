"""Loading a draft head (``models.eagle``): an EAGLE head's folder (its Llama config.json checked against the
target's) or a DeepSeek target's MTP layer, from safetensors or as random weights of the config, the
target's embedding and lm_head shared."""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import configs as model_configs, deepseek, llama
from jaxserve.models.config_fields import freeze
from jaxserve.models.eagle import ARCHITECTURE, FAMILY, MTP_ARCHITECTURE, MTP_FAMILY
from jaxserve.models.hf_weights import load_weights
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.safetensors_loader import safetensors_getter


def head_config(hf: dict, target_cfg: ModelConfig, fc_bias: bool) -> ModelConfig:
    """The head's ``ModelConfig`` from its Llama config.json, refused where it cannot share the target's
    embedding and lm_head."""
    if hf.get("add_para_norm"):
        raise ModelLoadError("EAGLE head with add_para_norm (HASS: norms of the embedding and hidden state before "
                             "fc) is not supported")
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
    return _head_model(cfg, FAMILY, params, target, path, load_format)


def mtp_config(hf: dict) -> ModelConfig:
    """DeepSeek's first multi-token-prediction layer (layer ``num_hidden_layers`` of its checkpoint) as a
    one-layer model: MoE where the target's layer of that index would be."""
    cfg = model_configs.model_config_from_hf(hf)
    extra = cfg.extra_dict
    if cfg.model_type not in deepseek.MODEL_TYPES:
        raise ModelLoadError(f"deepseek_mtp needs a DeepSeek V2 / V3 model, not model_type {cfg.model_type!r}")
    if not int(extra.get("num_nextn_predict_layers") or 0):
        raise ModelLoadError("deepseek_mtp: this checkpoint has no multi-token-prediction layers "
                             "(num_nextn_predict_layers is 0)")
    layer = cfg.num_layers
    first_dense, freq = int(extra["first_k_dense_replace"] or 0), int(extra["moe_layer_freq"] or 1)
    is_moe = layer >= first_dense and layer % freq == 0
    extra = {**extra, "first_k_dense_replace": 0 if is_moe else 1, "moe_layer_freq": 1, "mtp": True,
             "mtp_layer": layer}
    return dataclasses.replace(cfg, architecture=MTP_ARCHITECTURE, num_layers=1, extra=freeze(extra))


def load_mtp_head(path: str, target: LoadedModel, *, load_format: str = "auto", seed: int = 0) -> LoadedModel:
    """DeepSeek's MTP layer from the target's folder ``path`` (``load_format="dummy"``: random weights), on the
    target's device and in its dtype, sharing its embedding and lm_head (``shared_head.head`` holds the same)."""
    path = os.path.expanduser(path or "")
    if not os.path.isdir(path):
        raise ModelLoadError(f"deepseek_mtp: {path!r} is not a model folder (its MTP layers are read from the "
                             "target's safetensors)")
    cfg = mtp_config(model_configs.read_json(os.path.join(path, "config.json")))
    if load_format == "dummy":
        params = MTP_FAMILY.init_dummy_params(cfg, target.dtype, seed=seed)
    else:
        get, file_of = safetensors_getter(path)
        params = load_weights(cfg, MTP_FAMILY, get, target.dtype, file_of=file_of, desc="Loading the MTP layer")
    return _head_model(cfg, MTP_FAMILY, params, target, path, load_format)


def _head_model(cfg: ModelConfig, family, params: dict, target: LoadedModel, path: str,
                load_format: str) -> LoadedModel:
    """The head with the target's embedding and lm_head arrays (shared, not copied)."""
    params["embed"] = target.params["embed"]
    if "lm_head" in target.params:
        params["lm_head"] = target.params["lm_head"]
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=target.tokenizer,
                       chat_template=None, generation_config={}, source=path, dtype=target.dtype,
                       max_model_len=target.max_model_len, load_format="dummy" if load_format == "dummy"
                       else "safetensors")
