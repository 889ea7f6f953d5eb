"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama block with fused checkpoint projections (``qkv_proj`` and
``gate_up_proj``, split into q/k/v and stacked gate/up at load so tensor parallelism shards heads and the MLP
as for Llama), LongRoPE scaling, and RoPE on the leading ``partial_rotary_factor`` of each head."""
from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.rotary import make_rotary


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    rotary_dim = int(cfg.head_dim * cfg.extra_dict.get("partial_rotary_factor", 1.0))
    rotary = make_rotary(cfg.rope_theta, rotary_dim, cfg.rope_scaling_dict, cfg.max_position_embeddings)
    return DecoderSpec(sm_scale=cfg.head_dim ** -0.5, windows=(cfg.sliding_window,) * cfg.num_layers,
                       rotaries=(rotary,), layer_rotary=(0,) * cfg.num_layers)


def layer_names(cfg: ModelConfig) -> dict:
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = ["self_attn.qkv_proj.weight"]
    return {**checkpoint_names.LLAMA_LAYER,
            "q": (("rows_t", 0, q_out), qkv), "k": (("rows_t", q_out, q_out + kv_out), qkv),
            "v": (("rows_t", q_out + kv_out, q_out + 2 * kv_out), qkv),
            "gate_up": ("fused_gate_up_t", ["mlp.gate_up_proj.weight"])}


FAMILY = DecoderFamily(decoder_spec, llama.check_config, layer_names)
