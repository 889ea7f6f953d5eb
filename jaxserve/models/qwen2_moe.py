"""Qwen2-MoE (``Qwen2MoeForCausalLM``, e.g. Qwen1.5-MoE-A2.7B): the Qwen2 block (q/k/v bias) with
mixture-of-experts MLPs — top-4 of 60 experts (weights not renormalised unless ``norm_topk_prob``) plus a
shared expert every token goes through, scaled by ``sigmoid(h @ shared_expert_gate)``."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import llama, qwen3_moe
from jaxserve.models.config_fields import family_extra
from jaxserve.models.gguf_config import GGUFArch, GGUFMeta
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec

DEFAULTS = {"num_experts_per_tok": 4, "norm_topk_prob": False, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": ()}
# the shared expert and its sigmoid gate (relative to "model.layers.<i>.")
SHARED_EXPERT = {
    "shared_gate_up": ("stack_t", ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"]),
    "shared_down": ("t", ["mlp.shared_expert.down_proj.weight"]),
    "shared_gate": ("t", ["mlp.shared_expert_gate.weight"]),
}


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    moe.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    extra = cfg.extra_dict
    spec = moe.moe_spec(cfg, renormalize=bool(extra["norm_topk_prob"]), weights_in_hidden_dtype=True,
                        shared_intermediate_size=int(extra["shared_expert_intermediate_size"]) or None)
    return dataclasses.replace(llama.decoder_spec(cfg), moe=spec)


def layer_names(cfg: ModelConfig) -> dict:
    return {**qwen3_moe.layer_names(cfg), **SHARED_EXPERT}


def read_hf(hf: dict, fields: dict) -> dict:
    """q/k/v bias, as Qwen2, unless the config turns it off (``qkv_bias``)."""
    bias = {"attention_bias": True} if hf.get("qkv_bias", True) else {}
    extra = moe.experts_from_hf(hf, family_extra(hf, DEFAULTS))
    return fields | llama.qwen_sliding_window(hf) | bias | {"extra": extra}


def gguf_hf_config(m: GGUFMeta, reader) -> dict:
    """Routing weights not renormalised (llama.cpp's and transformers' GGUF default for Qwen2-MoE); the shared
    expert's width (``expert_shared_feed_forward_length``, else its tensor's)."""
    shared = m.meta.get("qwen2moe.expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_gate_shexp.weight" in m.tensor_names:
        shared = next(t.shape[1] for t in reader.tensors if t.name == "blk.0.ffn_gate_shexp.weight")
    return qwen3_moe.gguf_moe_config(m) | {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "norm_topk_prob": False,
        "shared_expert_intermediate_size": int(shared or 0), "qkv_bias": "blk.0.attn_q.bias" in m.tensor_names}


def gate_as_row(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """llama.cpp keeps the shared expert's gate as a vector; HF's is a ``[1, hidden]`` Linear."""
    return w.reshape(1, -1) if name.endswith(".ffn_gate_inp_shexp.weight") else w


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names, architectures=("Qwen2MoeForCausalLM",),
                       model_types={"qwen2_moe": "Qwen2MoeForCausalLM"}, read_hf=read_hf,
                       gguf={"qwen2moe": GGUFArch(hf_config=gguf_hf_config, fix_tensor=gate_as_row)})
