"""Gemma 2 and Gemma 3 (text): ``(1 + w)`` RMSNorms before and after both attention and the MLP, a tanh-GELU
gated MLP, embeddings scaled by ``sqrt(hidden_size)``, tied lm_head, attention scaled by
``query_pre_attn_scalar ** -0.5``, sliding-window layers interleaved with global ones (``layer_types``:
Gemma 2 alternates, Gemma 3 has five local to one global). Gemma 2 soft-caps the attention logits and the
final logits; Gemma 3 norms q and k per head instead and gives its local layers their own RoPE base.
``Gemma3ForConditionalGeneration`` is served as its text model (the vision tower's weights are not loaded;
requests are text only).

What a config source must give (``configs.model_config_from_hf`` does; a GGUF reader must too):
``model_type`` ``gemma2`` / ``gemma3_text``, ``hidden_act`` ``gelu_pytorch_tanh``, ``sliding_window``, and in
``ModelConfig.extra``: ``layer_types`` (one of ``LAYER_TYPES`` per layer), ``query_pre_attn_scalar``,
``attn_logit_softcapping`` / ``final_logit_softcapping`` (None = off), and for Gemma 3 ``local_rope``
(``(theta, rope_scaling pairs or None)`` of the sliding layers). Norm weights are HF's ``w`` of ``(1 + w)``.
"""
from __future__ import annotations

import math

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import checkpoint_names
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.rotary import make_rotary

LAYER_TYPES = ("sliding_attention", "full_attention")

LAYER_NAMES = {**checkpoint_names.LLAMA_LAYER,
               "post_attn_norm": ("same", ["post_attention_layernorm.weight"]),
               "mlp_norm": ("same", ["pre_feedforward_layernorm.weight"]),
               "post_mlp_norm": ("same", ["post_feedforward_layernorm.weight"])}


def check_config(cfg: ModelConfig) -> None:
    extra = cfg.extra_dict
    if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"hidden_activation {cfg.hidden_act!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.attention_bias:
        raise ModelLoadError("attention_bias=true is not supported for Gemma")
    if extra.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention=true (an encoder) is not supported")
    layer_types = extra.get("layer_types") or ()
    if len(layer_types) != cfg.num_layers or set(layer_types) - set(LAYER_TYPES):
        raise ModelLoadError(f"layer_types must list {cfg.num_layers} of {LAYER_TYPES}, got {layer_types}")
    if "sliding_attention" in layer_types and not cfg.sliding_window:
        raise ModelLoadError("layer_types has sliding_attention layers but sliding_window is not set")


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    extra = cfg.extra_dict
    gemma3 = cfg.model_type == "gemma3_text"
    global_rope = make_rotary(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling_dict, cfg.max_position_embeddings)
    rotaries = (global_rope,)
    local = [t == "sliding_attention" for t in extra["layer_types"]]
    if gemma3:
        theta, scaling = extra["local_rope"]
        rotaries += (make_rotary(theta, cfg.head_dim, dict(scaling) if scaling else None,
                                 cfg.max_position_embeddings),)
    return DecoderSpec(
        norm="offset_rms", qk_norm=gemma3, sandwich_norms=True, activation="gelu_tanh",
        embed_scale=math.sqrt(cfg.hidden_size), sm_scale=float(extra["query_pre_attn_scalar"]) ** -0.5,
        attn_soft_cap=extra.get("attn_logit_softcapping"), final_soft_cap=extra.get("final_logit_softcapping"),
        windows=tuple(cfg.sliding_window if is_local else None for is_local in local), rotaries=rotaries,
        layer_rotary=tuple(1 if gemma3 and is_local else 0 for is_local in local))


FAMILY = DecoderFamily(decoder_spec, check_config, LAYER_NAMES)
