"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama block with fused checkpoint projections (``qkv_proj`` and
``gate_up_proj``, split into q/k/v and stacked gate/up at load so tensor parallelism shards heads and the MLP
as for Llama), LongRoPE scaling (which older Phi-3 configs call ``yarn``), and RoPE on the leading
``partial_rotary_factor`` of each head. llama.cpp keeps the fused tensors and stores LongRoPE's factors as
tensors."""
from __future__ import annotations

import math

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.config_fields import family_extra
from jaxserve.models.gguf_config import GGUFArch, GGUFMeta, gguf_tensor
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
    return {**llama.LAYER_NAMES,
            "q": (("rows_t", 0, q_out), qkv), "k": (("rows_t", q_out, q_out + kv_out), qkv),
            "v": (("rows_t", q_out + kv_out, q_out + 2 * kv_out), qkv),
            "gate_up": ("fused_gate_up_t", ["mlp.gate_up_proj.weight"])}


# ------------------------------------------------------------------------------------------ HF config
def unwrap_hf(hf: dict) -> dict:
    """RoPE type ``yarn`` in a Phi-3 config is LongRoPE (transformers renames it too)."""
    out = dict(hf)
    for key in ("rope_scaling", "rope_parameters"):
        params = out.get(key)
        if isinstance(params, dict) and "yarn" in (params.get("rope_type"), params.get("type")):
            out[key] = {k: "longrope" if k in ("rope_type", "type") and v == "yarn" else v
                        for k, v in params.items()}
    return out


def read_hf(hf: dict, fields: dict) -> dict:
    extra = family_extra(hf, {"partial_rotary_factor": 1.0})
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")     # transformers 5 keeps it there
    extra["partial_rotary_factor"] = float(factor or extra["partial_rotary_factor"])
    return fields | {"extra": extra}


# ------------------------------------------------------------------------------------------------ GGUF
# attn_qkv is qkv_proj, ffn_up the gate-then-up gate_up_proj
GGUF_TENSOR_NAMES = ((r"\.self_attn\.qkv_proj\.", ".attn_qkv."), (r"\.mlp\.gate_up_proj\.", ".ffn_up."))


def gguf_hf_config(m: GGUFMeta, reader) -> dict:
    """RoPE on ``rope.dimension_count`` features of each head; a sliding window of 0 is none; LongRoPE as
    llama.cpp stores it: the ``rope_factors_long`` / ``rope_factors_short`` tensors, the original context
    length and the attention factor in the metadata."""
    c = m.common()
    rotary = int(m.get("rope.dimension_count", c["head_dim"]))
    window = int(m.meta.get("phi3.attention.sliding_window") or 0)
    c |= {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
          "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-5),
          "partial_rotary_factor": rotary / c["head_dim"], "sliding_window": window or None,
          "eos_token_id": m.eos_ids("<|end|>")}
    factors = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
    present = [n for n in factors.values() if n in m.tensor_names]
    if present:
        if len(present) != 2 or reader is None:
            raise ModelLoadError("this Phi-3 GGUF's LongRoPE needs both rope_factors_long and rope_factors_short")
        original = int(m.get("rope.scaling.original_context_length"))
        c["original_max_position_embeddings"] = original
        c["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                             **{k: gguf_tensor(reader, n).reshape(-1).tolist() for k, n in factors.items()}}
        # llama.cpp stores the attention factor HF derives from the two lengths (in float32): kept only when
        # it is another value
        stored, scale = m.real("rope.scaling.attn_factor"), c["max_position_embeddings"] / original
        derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if stored is not None and abs(stored - derived) > 1e-6 * derived:
            c["rope_scaling"]["attention_factor"] = stored
    return c


FAMILY = DecoderFamily(decoder_spec, llama.check_config, layer_names, architectures=("Phi3ForCausalLM",),
                       model_types={"phi3": "Phi3ForCausalLM"}, read_hf=read_hf, unwrap_hf=unwrap_hf,
                       gguf={"phi3": GGUFArch(hf_config=gguf_hf_config, tensor_names=GGUF_TENSOR_NAMES)})
