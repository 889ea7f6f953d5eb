"""Qwen3 (dense): the Llama block with a per-head RMSNorm of q and k before RoPE, and no q/k/v bias."""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return dataclasses.replace(llama.decoder_spec(cfg), qk_norm=True)


FAMILY = DecoderFamily(decoder_spec, llama.check_config)
