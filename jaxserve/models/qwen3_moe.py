"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): the Qwen3 block (per-head q/k RMSNorm) with
mixture-of-experts MLPs — top-8 of 128 experts, weights renormalised when ``norm_topk_prob`` (it is, for the
released models); layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` keep a dense MLP."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama, qwen3
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    moe.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    spec = moe.moe_spec(cfg, renormalize=bool(cfg.extra_dict["norm_topk_prob"]), weights_in_hidden_dtype=True)
    return dataclasses.replace(qwen3.decoder_spec(cfg), moe=spec)


def layer_names(cfg: ModelConfig) -> dict:
    """Llama names for attention and the dense layers' MLP, ``mlp.experts.<e>.*`` for the MoE layers'."""
    return {**checkpoint_names.LLAMA_LAYER,
            **checkpoint_names.moe_layer_names(cfg.extra_dict["num_experts"], "mlp", router="gate",
                                               gate="gate_proj", up="up_proj", down="down_proj")}


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names)
