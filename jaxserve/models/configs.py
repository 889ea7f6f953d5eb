"""Model configs: an HF ``config.json`` (or ``transformers`` config object) or GGUF metadata → ``ModelConfig``.

One reader per source, both ending in the same frozen ``jaxserve.config.ModelConfig`` (a static jit arg).
RoPE parameters are normalised to one shape whatever the transformers version wrote: ``rope_theta`` on the
config and ``rope_scaling`` as ``(("rope_type", ...), ...)`` pairs, or ``None`` for plain RoPE.
"""
from __future__ import annotations

import json
import os
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError

# RoPE variants layers.rotary implements; "dynamic" (NTK) depends on each request's length, which a ragged
# batch does not have one of, so it is refused rather than silently approximated.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
# the families' model_type → architecture, for configs without an "architectures" list
MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                            "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                            "cohere": "CohereForCausalLM", "mixtral": "MixtralForCausalLM",
                            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# family hyper-parameters kept in ModelConfig.extra, with HF's defaults where config.json may omit them
FAMILY_DEFAULTS = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window_pattern": 2},
    "gemma3_text": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window_pattern": 6},
    "phi3": {"partial_rotary_factor": 1.0},
    "cohere": {"logit_scale": 0.0625, "use_qk_norm": False},
    "qwen3": {},
    # mixture of experts (layers.moe reads these; the expert count is "num_experts" whatever the config calls it)
    "mixtral": {"num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts_per_tok": 4, "norm_topk_prob": False, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": ()},
    "qwen3_moe": {"num_experts_per_tok": 8, "norm_topk_prob": True, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "mlp_only_layers": ()},
}
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")   # sliding_window only counts with use_sliding_window
# fields a family reads from config.json as they are (beyond FAMILY_DEFAULTS' keys)
FAMILY_FIELDS = ("layer_types", "use_sliding_window", "attention_bias", "final_logit_softcapping",
                 "attn_logit_softcapping", "use_bidirectional_attention", "max_window_layers")
# GGUF only: llama.cpp bakes Llama 3.1 RoPE scaling into a per-frequency divisor tensor (rope_freqs.weight)
GGUF_FREQ_FACTORS = "freq_factors"

# GGUF ``general.architecture`` → the HF architecture name the registry knows (read here), and the
# architectures whose GGUF metadata the loader turns into an HF config first (``loader.gguf_hf_config``).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GGUF_HF_CONFIG_ARCHITECTURES = ("gemma2", "gemma3", "qwen3", "phi3", "command-r", "qwen2moe", "qwen3moe")


def _freeze(value: Any) -> Any:
    """Lists → tuples, recursively, so the value can sit in a hashable ModelConfig."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _rope(hf: dict, layer_type: str = "full_attention") -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling pairs) from either transformers 4 (``rope_theta`` + ``rope_scaling``) or
    transformers 5 (``rope_parameters``, per layer type for Gemma 3) spelling."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    elif layer_type == "sliding_attention":     # transformers 4 Gemma 3: the local layers' plain-RoPE base
        return float(hf.get("rope_local_base_freq") or 10000.0), None
    scaling = params
    if hf.get("rope_scaling") and layer_type == "full_attention":   # the older, more specific key wins
        scaling = {k: v for k, v in scaling.items() if k == "rope_theta"} | dict(hf["rope_scaling"])
    theta = float(scaling.pop("rope_theta", hf.get("rope_theta") or 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)
    if rope_type == "su" or (rope_type == "yarn" and hf.get("model_type") == "phi3"):
        rope_type = "longrope"     # Phi-3's old names of LongRoPE (transformers renames them too)
    if rope_type in ("longrope", "yarn") and hf.get("original_max_position_embeddings"):
        scaling.setdefault("original_max_position_embeddings", int(hf["original_max_position_embeddings"]))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    return theta, _freeze({"rope_type": rope_type, **scaling})


# multimodal configs whose text part a family serves: model_type → the text config's model_type
TEXT_CONFIG_WRAPPERS = {"gemma3": "gemma3_text"}
# top-level fields of such a config that describe the whole model (and win over the text config's)
WRAPPER_FIELDS = ("architectures", "eos_token_id", "bos_token_id", "torch_dtype", "dtype")


def _text_part(hf: dict) -> dict:
    """The text model's config of a multimodal one (Gemma 3's ``text_config``), with transformers' defaults
    filled in (the hub configs list only what differs from them), under the wrapper's architecture."""
    from transformers import AutoConfig

    text_type = TEXT_CONFIG_WRAPPERS[hf["model_type"]]
    text = dict(hf.get("text_config") or {})
    text.pop("model_type", None)
    full = AutoConfig.for_model(text_type, **text).to_dict()
    return full | {k: hf[k] for k in WRAPPER_FIELDS if k in hf} | {"model_type": text_type}


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def model_config_from_hf(hf_config: Any, generation_config: dict | None = None) -> ModelConfig:
    """``ModelConfig`` from an HF config: a ``config.json`` dict or a ``transformers.PretrainedConfig``.

    ``generation_config`` (the model's ``generation_config.json``), when given, decides the eos ids: Llama 3
    instruct models stop on several tokens that only it lists.
    """
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    if hf.get("model_type") in TEXT_CONFIG_WRAPPERS:
        hf = _text_part(hf)
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type", "llama")
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, rope_scaling = _rope(hf)
        qwen2 = model_type == "qwen2" or (model_type == "qwen2_moe" and hf.get("qkv_bias", True))
        if model_type in QWEN_TYPES and hf.get("use_sliding_window"):
            raise ModelLoadError(f"{model_type} use_sliding_window=true (per-layer windows) is not supported")
        # Qwen configs carry a sliding_window value that only use_sliding_window turns on
        sliding = None if model_type in QWEN_TYPES else hf.get("sliding_window")
        gen = generation_config or {}
        extra = _family_extra(hf, model_type, int(hf["num_hidden_layers"]))
        return ModelConfig(
            architecture=archs[0] if archs else MODEL_TYPE_ARCHITECTURES.get(model_type, "LlamaForCausalLM"),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", hf.get("layer_norm_eps", 1e-6))),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if qwen2 else bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=gen.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=_eos_ids(gen.get("eos_token_id", hf.get("eos_token_id"))),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
            model_type=model_type,
            extra=_freeze(extra),
        )
    except KeyError as e:
        raise ModelLoadError(f"model config is missing the field {e.args[0]!r}") from None


def _family_extra(hf: dict, model_type: str, num_layers: int) -> dict:
    """The family hyper-parameters beyond ModelConfig's fields (``ModelConfig.extra``)."""
    if model_type not in FAMILY_DEFAULTS:
        return {}
    extra = {k: hf.get(k, v) for k, v in FAMILY_DEFAULTS[model_type].items()}
    extra |= {k: hf[k] for k in FAMILY_FIELDS if k in hf}
    if "sliding_window_pattern" in extra and not extra.get("layer_types"):
        pattern = int(hf.get("sliding_window_pattern") or extra["sliding_window_pattern"])
        extra["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(num_layers)]
    if model_type == "gemma3_text":
        extra["local_rope"] = _rope(hf, "sliding_attention")
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        # Mixtral and transformers 5's Qwen3-MoE say num_local_experts; Mixtral's experts use intermediate_size
        extra["num_experts"] = int(hf.get("num_experts") or hf.get("num_local_experts") or 8)
        extra.setdefault("moe_intermediate_size", int(hf["intermediate_size"]))
    if model_type == "phi3":
        factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        extra["partial_rotary_factor"] = float(factor or extra["partial_rotary_factor"])
    return extra


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def model_config_from_folder(folder: str) -> tuple[ModelConfig, dict, dict]:
    """(ModelConfig, raw config.json, generation_config.json or {}) of an HF model folder."""
    hf = read_json(os.path.join(folder, "config.json"))
    gen_path = os.path.join(folder, "generation_config.json")
    gen = read_json(gen_path) if os.path.exists(gen_path) else {}
    return model_config_from_hf(hf, gen), hf, gen


def model_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], rope_freqs=None) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (llama.cpp's key names), the way transformers' GGUF loader reads it.

    ``rope_freqs``: the values of a ``rope_freqs.weight`` tensor when the file has one (Llama 3.1 GGUFs):
    llama.cpp divides each RoPE frequency by it, which is how it stores llama3 scaling.
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join((*GGUF_ARCHITECTURES, *GGUF_HF_CONFIG_ARCHITECTURES))}")
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
            eos_token_ids=_eos_ids(eos),
            model_type=model_type,
        )
    except TypeError:
        raise ModelLoadError(f"GGUF metadata is missing a {arch}.* hyper-parameter") from None
