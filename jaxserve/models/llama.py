"""The Llama family (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, SmolLM2) on the shared decoder layers.

Pre-norm RMSNorm blocks, GQA attention with optional q/k/v bias (Qwen2), a SiLU-gated MLP, RoPE with
default / linear / llama3 / YaRN scaling (GGUF: llama.cpp's per-frequency factors), an optional sliding
window on every layer (Mistral), tied or separate lm_head.
"""
from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.norms import rms_norm  # noqa: F401  (the family's norm, for callers outside the model)
from jaxserve.models.layers.rotary import make_rotary


def check_config(cfg: ModelConfig) -> None:
    """Refuse the configs this implementation would silently get wrong."""
    if cfg.hidden_act != "silu":
        raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
    if cfg.mlp_bias:
        raise ModelLoadError("mlp_bias=true is not supported")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"num_attention_heads {cfg.num_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_kv_heads}")


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    rotary = make_rotary(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling_dict, cfg.max_position_embeddings)
    return DecoderSpec(attention_bias=cfg.attention_bias, sm_scale=cfg.head_dim ** -0.5,
                       windows=(cfg.sliding_window,) * cfg.num_layers, rotaries=(rotary,),
                       layer_rotary=(0,) * cfg.num_layers)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` in float32, as transformers computes them."""
    return np.asarray(decoder_spec(cfg).rotaries[0].inv_freq, np.float32)


FAMILY = DecoderFamily(decoder_spec, check_config)
