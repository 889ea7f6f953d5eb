"""Gemma 2 and Gemma 3 (text): ``(1 + w)`` RMSNorms before and after both attention and the MLP, a tanh-GELU
gated MLP, embeddings scaled by ``sqrt(hidden_size)``, tied lm_head, attention scaled by
``query_pre_attn_scalar ** -0.5``, sliding-window layers interleaved with global ones (``layer_types``:
Gemma 2 alternates, Gemma 3 has five local to one global). Gemma 2 soft-caps the attention logits and the
final logits; Gemma 3 norms q and k per head instead and gives its local layers their own RoPE base.
``Gemma3ForConditionalGeneration`` (its vision tower and projector) is ``gemma3_vision``'s, on this decoder.

What a config source must give (``read_hf`` does for config.json, ``gguf_hf_config`` for GGUF metadata):
``model_type`` ``gemma2`` / ``gemma3_text``, ``hidden_act`` ``gelu_pytorch_tanh``, ``sliding_window``, and in
``ModelConfig.extra``: ``layer_types`` (one of ``LAYER_TYPES`` per layer), ``query_pre_attn_scalar``,
``attn_logit_softcapping`` / ``final_logit_softcapping`` (None = off), and for Gemma 3 ``local_rope``
(``(theta, rope_scaling pairs or None)`` of the sliding layers). Norm weights are HF's ``w`` of ``(1 + w)``
(llama.cpp stores ``1 + w``).
"""
from __future__ import annotations

import math

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.config_fields import family_extra, rope
from jaxserve.models.gguf_config import GGUFArch, GGUFMeta
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.rotary import make_rotary

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
LAYER_TYPES = ("sliding_attention", "full_attention")

LAYER_NAMES = {**llama.LAYER_NAMES,
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


# ------------------------------------------------------------------------------------------ HF config
# HF's values where config.json may omit them
DEFAULTS = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window_pattern": 2},
    "gemma3_text": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window_pattern": 6},
}
# top-level fields of a multimodal config that describe the whole model (and win over the text config's)
WRAPPER_FIELDS = ("architectures", "eos_token_id", "bos_token_id", "torch_dtype", "dtype")


def unwrap_hf(hf: dict) -> dict:
    """Gemma 3's multimodal config → its text config, with transformers' defaults filled in (the hub configs
    list only what differs from them), under the wrapper's architecture (``gemma3_vision`` adds the rest)."""
    if hf.get("model_type") != "gemma3":
        return hf
    from transformers import AutoConfig  # noqa: PLC0415

    text = dict(hf.get("text_config") or {})
    text.pop("model_type", None)
    full = AutoConfig.for_model("gemma3_text", **text).to_dict()
    return full | {k: hf[k] for k in WRAPPER_FIELDS if k in hf} | {"model_type": "gemma3_text"}


def read_hf(hf: dict, fields: dict) -> dict:
    """``extra``: the defaults, ``layer_types`` from ``sliding_window_pattern`` when the config lists none,
    and Gemma 3's local RoPE (transformers 5: ``rope_parameters["sliding_attention"]``; 4: a plain RoPE of
    base ``rope_local_base_freq``)."""
    extra = family_extra(hf, DEFAULTS[hf["model_type"]])
    if not extra.get("layer_types"):
        pattern = int(hf.get("sliding_window_pattern") or extra["sliding_window_pattern"])
        extra["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(fields["num_layers"])]
    if hf["model_type"] == "gemma3_text":
        if "sliding_attention" in (hf.get("rope_parameters") or {}):
            extra["local_rope"] = rope(hf, "sliding_attention")
        else:
            extra["local_rope"] = (float(hf.get("rope_local_base_freq") or 10000.0), None)
    return fields | {"extra": extra}


# ------------------------------------------------------------------------------------------------ GGUF
# llama.cpp's names of Gemma's four norms per layer: post_attention_layernorm is its own tensor there, ffn_norm
# the pre-MLP one
GGUF_TENSOR_NAMES = ((r"\.post_attention_layernorm\.", ".post_attention_norm."),
                     (r"\.pre_feedforward_layernorm\.", ".ffn_norm."),
                     (r"\.post_feedforward_layernorm\.", ".post_ffw_norm."))


def gguf_hf_config(m: GGUFMeta, reader) -> dict:
    """Gemma 2 / 3: the values llama.cpp does not store are the ones it hard-codes: Gemma 2 alternates
    sliding-window and global layers and soft-caps as its metadata says; Gemma 3 has five sliding-window layers
    to one global, local RoPE base 10000 and no soft-capping; queries are scaled by 1/sqrt(head_dim) (the 27B
    models, 46 and 62 layers: 1/sqrt(hidden/heads)); ``<end_of_turn>`` ends generation as ``<eos>`` does."""
    c = m.common()
    layers, gemma3 = c["num_hidden_layers"], m.arch == "gemma3"
    pattern = 6 if gemma3 else 2
    big = layers == (62 if gemma3 else 46)
    c |= {"architectures": ["Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"],
          "model_type": "gemma3_text" if gemma3 else "gemma2",
          "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-6),
          "sliding_window": int(m.get("attention.sliding_window")),
          "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
          "query_pre_attn_scalar": c["hidden_size"] // c["num_attention_heads"] if big else c["head_dim"],
          "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": m.eos_ids("<end_of_turn>")}
    if gemma3:
        c |= {"rope_theta": m.real("rope.freq_base", 1e6), "rope_local_base_freq": 10000.0,
              "final_logit_softcapping": None, "attn_logit_softcapping": None}
    else:
        c |= {"final_logit_softcapping": m.real("final_logit_softcapping"),
              "attn_logit_softcapping": m.real("attn_logit_softcapping")}
    return c


def unshift_norm(name: str, w: np.ndarray, cfg: ModelConfig | None) -> np.ndarray:
    """llama.cpp's Gemma RMSNorm multiplies by the stored weight itself: it stores HF's ``w`` as ``1 + w``."""
    return w - 1.0 if name.endswith("norm.weight") else w


GGUF = {arch: GGUFArch(hf_config=gguf_hf_config, tensor_names=GGUF_TENSOR_NAMES, fix_tensor=unshift_norm)
        for arch in ("gemma2", "gemma3")}

FAMILY = DecoderFamily(decoder_spec, check_config, LAYER_NAMES, architectures=ARCHITECTURES,
                       model_types=MODEL_TYPES, read_hf=read_hf, gguf=GGUF)
