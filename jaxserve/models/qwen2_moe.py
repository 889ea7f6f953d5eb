"""Qwen2-MoE (``Qwen2MoeForCausalLM``, e.g. Qwen1.5-MoE-A2.7B): the Qwen2 block (q/k/v bias) with
mixture-of-experts MLPs — top-4 of 60 experts (weights not renormalised unless ``norm_topk_prob``) plus a
shared expert every token goes through, scaled by ``sigmoid(h @ shared_expert_gate)``."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama, qwen3_moe
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    moe.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    extra = cfg.extra_dict
    spec = moe.moe_spec(cfg, renormalize=bool(extra["norm_topk_prob"]), weights_in_hidden_dtype=True,
                        shared_intermediate_size=int(extra["shared_expert_intermediate_size"]) or None)
    return dataclasses.replace(llama.decoder_spec(cfg), moe=spec)


def layer_names(cfg: ModelConfig) -> dict:
    return {**qwen3_moe.layer_names(cfg), **checkpoint_names.SHARED_EXPERT}


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names)
