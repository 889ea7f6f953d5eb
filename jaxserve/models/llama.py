"""The Llama family (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, SmolLM2) on the shared decoder layers.

Pre-norm RMSNorm blocks, GQA attention with optional q/k/v bias (Qwen2), a SiLU-gated MLP, RoPE with
default / linear / llama3 / YaRN scaling (GGUF: llama.cpp's per-frequency factors), an optional sliding
window on every layer (Mistral), tied or separate lm_head. Its checkpoint names (``LAYER_NAMES``) are the
layout most families keep and extend.

Config quirks: Qwen2 always has q/k/v bias, and a Qwen config's ``sliding_window`` counts only with
``use_sliding_window`` (per-layer windows, refused). GGUF: llama.cpp's ``llama`` (Mistral told apart by the
model's name) and ``qwen2`` metadata read straight into a ``ModelConfig``; llama.cpp's converter permutes
Llama's q/k rows for its RoPE, undone at load.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models.config_fields import eos_ids
from jaxserve.models.gguf_config import GGUFArch
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.norms import rms_norm  # noqa: F401  (the family's norm, for callers outside the model)
from jaxserve.models.layers.rotary import make_rotary

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# weight name → (build, HF names relative to "model.layers.<i>.")
LAYER_NAMES = {
    "attn_norm": ("same", ["input_layernorm.weight"]),
    "mlp_norm": ("same", ["post_attention_layernorm.weight"]),
    "q": ("t", ["self_attn.q_proj.weight"]), "k": ("t", ["self_attn.k_proj.weight"]),
    "v": ("t", ["self_attn.v_proj.weight"]), "o": ("t", ["self_attn.o_proj.weight"]),
    "gate_up": ("stack_t", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "down": ("t", ["mlp.down_proj.weight"]),
    "q_bias": ("same", ["self_attn.q_proj.bias"]), "k_bias": ("same", ["self_attn.k_proj.bias"]),
    "v_bias": ("same", ["self_attn.v_proj.bias"]),
    "q_norm": ("same", ["self_attn.q_norm.weight"]), "k_norm": ("same", ["self_attn.k_norm.weight"]),
}


def check_config(cfg: ModelConfig) -> None:
    """Refuse the configs this implementation would silently get wrong."""
    if cfg.hidden_act != "silu":
        raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
    if cfg.mlp_bias:
        raise ModelLoadError("mlp_bias=true is not supported")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"num_attention_heads {cfg.num_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_kv_heads}")


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    rotary = make_rotary(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling_dict, cfg.max_position_embeddings)
    return DecoderSpec(attention_bias=cfg.attention_bias, sm_scale=cfg.head_dim ** -0.5,
                       windows=(cfg.sliding_window,) * cfg.num_layers, rotaries=(rotary,),
                       layer_rotary=(0,) * cfg.num_layers)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` in float32, as transformers computes them."""
    return np.asarray(decoder_spec(cfg).rotaries[0].inv_freq, np.float32)


# ------------------------------------------------------------------------------------------ HF config
def qwen_sliding_window(hf: dict) -> dict:
    """The fields of a Qwen config (every Qwen family): the ``sliding_window`` value it carries counts only
    with ``use_sliding_window``, whose per-layer windows are not supported."""
    if hf.get("use_sliding_window"):
        raise ModelLoadError(f"{hf.get('model_type')} use_sliding_window=true (per-layer windows) is not supported")
    return {"sliding_window": None}


def read_hf(hf: dict, fields: dict) -> dict:
    if hf.get("model_type") != "qwen2":
        return fields
    return fields | qwen_sliding_window(hf) | {"attention_bias": True}


# ------------------------------------------------------------------------------------------------ GGUF
# llama.cpp bakes Llama 3.1 RoPE scaling into a per-frequency divisor tensor (rope_freqs.weight)
GGUF_FREQ_FACTORS = "freq_factors"
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def refuse_gguf_experts(meta: dict[str, Any]) -> None:
    if meta.get("llama.expert_count"):
        raise ModelLoadError("this GGUF is a Mixtral-style mixture of experts (llama with expert_count), which "
                             "transformers does not read from GGUF and jaxserve does not either: load the "
                             "model's safetensors folder instead")


def model_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], rope_freqs=None) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (llama.cpp's key names), the way transformers' GGUF loader reads it.

    ``rope_freqs``: the values of a ``rope_freqs.weight`` tensor when the file has one (Llama 3.1 GGUFs):
    llama.cpp divides each RoPE frequency by it, which is how it stores llama3 scaling.
    """
    arch = meta.get("general.architecture")
    if "rope_freqs.weight" in tensor_names and rope_freqs is None:
        raise ModelLoadError("this GGUF has a rope_freqs tensor (Llama 3.1 RoPE factors): pass its values")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        vocab = get("vocab_size", meta.get("tokenizer.ggml.tokens#count"))
        if vocab is None:
            raise ModelLoadError("GGUF metadata has no vocab size")
        rope_scaling = None
        if get("rope.scaling.type") == "linear":
            rope_scaling = (("factor", float(get("rope.scaling.factor"))), ("rope_type", "linear"))
        elif get("rope.scaling.type") not in (None, "none"):
            raise ModelLoadError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
        if rope_freqs is not None:
            if rope_scaling is not None:
                raise ModelLoadError("GGUF with both rope_freqs and rope scaling metadata is not supported")
            factors = tuple(float(f) for f in rope_freqs.reshape(-1))
            rope_scaling = (("factors", factors), ("rope_type", GGUF_FREQ_FACTORS))
        name = str(meta.get("general.name", "")).lower()
        model_type = "qwen2" if arch == "qwen2" else ("mistral" if "mistral" in name else "llama")
        architecture = "MistralForCausalLM" if model_type == "mistral" else GGUF_ARCHITECTURES[arch]
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads))),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids(eos),
            model_type=model_type,
        )
    except TypeError:
        raise ModelLoadError(f"GGUF metadata is missing a {arch}.* hyper-parameter") from None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two RoPE halves);
    exactly transformers' ``LlamaTensorProcessor._reverse_permute_weights``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def unpermute_qk(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if ".attn_q." in name:
        return unpermute_rope_rows(w, cfg.num_heads)
    if ".attn_k." in name:
        return unpermute_rope_rows(w, cfg.num_kv_heads)
    return w


GGUF = {"llama": GGUFArch(model_config=model_config_from_gguf, check=refuse_gguf_experts, fix_tensor=unpermute_qk),
        "qwen2": GGUFArch(model_config=model_config_from_gguf)}

FAMILY = DecoderFamily(decoder_spec, check_config, LAYER_NAMES, architectures=ARCHITECTURES,
                       model_types=MODEL_TYPES, read_hf=read_hf, gguf=GGUF)
