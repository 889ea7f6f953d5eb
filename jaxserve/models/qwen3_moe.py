"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): the Qwen3 block (per-head q/k RMSNorm) with
mixture-of-experts MLPs — top-8 of 128 experts, weights renormalised when ``norm_topk_prob`` (it is, for the
released models); layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` keep a dense MLP."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama, qwen3
from jaxserve.models.config_fields import family_extra
from jaxserve.models.gguf_config import GGUFArch, GGUFMeta
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec

DEFAULTS = {"num_experts_per_tok": 8, "norm_topk_prob": True, "moe_intermediate_size": 768,
            "decoder_sparse_step": 1, "mlp_only_layers": ()}


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    moe.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    spec = moe.moe_spec(cfg, renormalize=bool(cfg.extra_dict["norm_topk_prob"]), weights_in_hidden_dtype=True)
    return dataclasses.replace(qwen3.decoder_spec(cfg), moe=spec)


def layer_names(cfg: ModelConfig) -> dict:
    """Llama names for attention and the dense layers' MLP, ``mlp.experts.<e>.*`` for the MoE layers'."""
    return {**llama.LAYER_NAMES,
            **checkpoint_names.moe_layer_names(cfg.extra_dict["num_experts"], "mlp", router="gate",
                                               gate="gate_proj", up="up_proj", down="down_proj")}


def read_hf(hf: dict, fields: dict) -> dict:
    return fields | llama.qwen_sliding_window(hf) | {"extra": moe.experts_from_hf(hf, family_extra(hf, DEFAULTS))}


def gguf_moe_config(m: GGUFMeta) -> dict:
    """What both Qwen MoE families' GGUFs give, as transformers reads them (``expert_count``,
    ``expert_used_count``), with the expert width llama.cpp stores (``expert_feed_forward_length``). A layer
    without stacked experts is a dense MLP (``mlp_only_layers``)."""
    experts_ff = int(m.get("expert_feed_forward_length"))
    if f"{m.arch}.feed_forward_length" not in m.meta:       # only the dense layers use it
        m = GGUFMeta({**m.meta, f"{m.arch}.feed_forward_length": experts_ff}, m.tensor_names)
    c = m.common()
    layers = c["num_hidden_layers"]
    return c | {"rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-6),
                "num_experts": int(m.get("expert_count")), "num_experts_per_tok": int(m.get("expert_used_count")),
                "moe_intermediate_size": experts_ff, "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in m.tensor_names],
                "eos_token_id": m.eos_ids("<|im_end|>")}


def gguf_hf_config(m: GGUFMeta, reader) -> dict:
    """Routing weights renormalised (llama.cpp's and transformers' GGUF default for Qwen3-MoE)."""
    return gguf_moe_config(m) | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                 "norm_topk_prob": True}


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names, architectures=("Qwen3MoeForCausalLM",),
                       model_types={"qwen3_moe": "Qwen3MoeForCausalLM"}, read_hf=read_hf,
                       gguf={"qwen3moe": GGUFArch(hf_config=gguf_hf_config)})
