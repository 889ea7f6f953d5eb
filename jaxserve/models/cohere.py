"""Command-R (``CohereForCausalLM``): one LayerNorm (no bias) feeds attention and the SiLU-gated MLP in
parallel, their outputs added to the residual together; interleaved-pair RoPE; tied embeddings; logits times
``logit_scale``. llama.cpp calls the architecture ``command-r``."""
from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.config_fields import family_extra
from jaxserve.models.gguf_config import GGUFArch, GGUFMeta
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.rotary import make_rotary


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    if cfg.extra_dict.get("use_qk_norm"):
        raise ModelLoadError("use_qk_norm=true (Command-R+) is not supported")
    if cfg.sliding_window:
        raise ModelLoadError("sliding_window is not supported for Cohere")


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    rotary = make_rotary(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling_dict, cfg.max_position_embeddings,
                         interleaved=True)
    return DecoderSpec(norm="layer", parallel_block=True, attention_bias=cfg.attention_bias,
                       sm_scale=cfg.head_dim ** -0.5, logit_scale=cfg.extra_dict.get("logit_scale"),
                       windows=(None,) * cfg.num_layers, rotaries=(rotary,), layer_rotary=(0,) * cfg.num_layers)


def read_hf(hf: dict, fields: dict) -> dict:
    return fields | {"extra": family_extra(hf, {"logit_scale": 0.0625, "use_qk_norm": False})}


def gguf_hf_config(m: GGUFMeta, reader) -> dict:
    return m.common() | {"architectures": ["CohereForCausalLM"], "model_type": "cohere", "hidden_act": "silu",
                         "layer_norm_eps": m.real("attention.layer_norm_epsilon", 1e-5),
                         "logit_scale": m.real("logit_scale", 1.0), "use_qk_norm": False,
                         "eos_token_id": m.eos_ids("<|END_OF_TURN_TOKEN|>")}


FAMILY = DecoderFamily(decoder_spec, check_config, llama.LAYER_NAMES, architectures=("CohereForCausalLM",),
                       model_types={"cohere": "CohereForCausalLM"}, read_hf=read_hf,
                       gguf={"command-r": GGUFArch(hf_config=gguf_hf_config)})
