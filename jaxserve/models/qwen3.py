"""Qwen3 (dense): the Llama block with a per-head RMSNorm of q and k before RoPE, and no q/k/v bias."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec

ARCHITECTURES = ("Qwen3ForCausalLM",)


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return dataclasses.replace(llama.decoder_spec(cfg), qk_norm=True)


def weight_plan(cfg: ModelConfig) -> list:
    return checkpoint_names.weight_plan(param_shapes(cfg))


_family = DecoderFamily(decoder_spec)
forward, compute_logits = _family.forward, _family.compute_logits
param_shapes, param_partition_specs = _family.param_shapes, _family.param_partition_specs
init_dummy_params = _family.init_dummy_params
