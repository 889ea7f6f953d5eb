"""Qwen3 (dense): the Llama block with a per-head RMSNorm of q and k before RoPE, and no q/k/v bias."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.config_fields import family_extra
from jaxserve.models.gguf_config import GGUFArch, GGUFMeta
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return dataclasses.replace(llama.decoder_spec(cfg), qk_norm=True)


def read_hf(hf: dict, fields: dict) -> dict:
    return fields | llama.qwen_sliding_window(hf) | {"extra": family_extra(hf, {})}


def gguf_hf_config(m: GGUFMeta, reader) -> dict:
    return m.common() | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                         "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-6),
                         "eos_token_id": m.eos_ids("<|im_end|>")}


FAMILY = DecoderFamily(decoder_spec, llama.check_config, llama.LAYER_NAMES, architectures=("Qwen3ForCausalLM",),
                       model_types={"qwen3": "Qwen3ForCausalLM"}, read_hf=read_hf,
                       gguf={"qwen3": GGUFArch(hf_config=gguf_hf_config)})
