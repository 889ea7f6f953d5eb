"""Mixtral (``MixtralForCausalLM``): the Llama/Mistral block with every MLP a mixture of experts — top-2 of 8
SiLU-gated experts per token, the two softmax weights renormalised to sum 1 (``layers.moe``). Its GGUF
(llama.cpp's ``llama`` with ``expert_count``) is refused (``llama.refuse_gguf_experts``)."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import checkpoint_names, llama
from jaxserve.models.config_fields import family_extra
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    moe.check_config(cfg)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return dataclasses.replace(llama.decoder_spec(cfg),
                               moe=moe.moe_spec(cfg, renormalize=True, weights_in_hidden_dtype=False))


def layer_names(cfg: ModelConfig) -> dict:
    return {**llama.LAYER_NAMES,
            **checkpoint_names.moe_layer_names(cfg.extra_dict["num_experts"], "block_sparse_moe", router="gate",
                                               gate="w1", up="w3", down="w2")}


def read_hf(hf: dict, fields: dict) -> dict:
    return fields | {"extra": moe.experts_from_hf(hf, family_extra(hf, {"num_experts_per_tok": 2}))}


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names, architectures=("MixtralForCausalLM",),
                       model_types={"mixtral": "MixtralForCausalLM"}, read_hf=read_hf)
