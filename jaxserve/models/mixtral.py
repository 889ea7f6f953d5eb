"""Mixtral (``MixtralForCausalLM``): the Llama/Mistral block with every MLP a mixture of experts — top-2 of 8
SiLU-gated experts per token, the two softmax weights renormalised to sum 1 (``layers.moe``)."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    moe.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return dataclasses.replace(llama.decoder_spec(cfg),
                               moe=moe.moe_spec(cfg, renormalize=True, weights_in_hidden_dtype=False))


def layer_names(cfg: ModelConfig) -> dict:
    return {**checkpoint_names.LLAMA_LAYER,
            **checkpoint_names.moe_layer_names(cfg.extra_dict["num_experts"], "block_sparse_moe", router="gate",
                                               gate="w1", up="w3", down="w2")}


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names)
