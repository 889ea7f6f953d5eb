"""Model configs: an HF ``config.json`` (or ``transformers`` config object) → ``ModelConfig``.

The shared reading (shapes, RoPE, eos ids) is the same for every family; the family that serves the config's
``model_type`` (``registry.family_of_model_type``) unwraps a multimodal config first (``unwrap_hf``) and then
adds what it reads differently (``read_hf``: its quirks, defaults and ``ModelConfig.extra``). GGUF metadata
reaches a ``ModelConfig`` through the family's GGUF reader (``gguf_loader``). The result is frozen
(``jaxserve.config.ModelConfig``, a static jit arg).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import registry
from jaxserve.models.config_fields import eos_ids, freeze, rope


def model_config_from_hf(hf_config: Any, generation_config: dict | None = None) -> ModelConfig:
    """``ModelConfig`` from an HF config: a ``config.json`` dict or a ``transformers.PretrainedConfig``.

    ``generation_config`` (the model's ``generation_config.json``), when given, decides the eos ids: Llama 3
    instruct models stop on several tokens that only it lists.
    """
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    family = registry.family_of_model_type(hf.get("model_type", "llama"))
    if family is not None:
        hf = family.unwrap_hf(hf)
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type", "llama")
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, rope_scaling = rope(hf)
        gen = generation_config or {}
        sliding = hf.get("sliding_window")
        default_architecture = family.model_types.get(model_type) if family is not None else None
        fields = dict(
            architecture=archs[0] if archs else default_architecture or "LlamaForCausalLM",
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
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=gen.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=eos_ids(gen.get("eos_token_id", hf.get("eos_token_id"))),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
            model_type=model_type,
            extra={},
        )
        if family is not None:
            fields = family.read_hf(hf, fields)
        return ModelConfig(**fields | {"extra": freeze(fields["extra"])})
    except KeyError as e:
        raise ModelLoadError(f"model config is missing the field {e.args[0]!r}") from None


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def with_hf_overrides(hf: dict, overrides: dict | None) -> dict:
    """``hf`` (a config.json) with vLLM's ``--hf-overrides`` applied: each key replaces the config's, except a
    dict given for a nested config (``text_config``, ``vision_config``, ...), whose keys are applied in turn."""
    if not overrides:
        return hf
    out = dict(hf)
    for key, value in overrides.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict) and key.endswith("_config")
        out[key] = with_hf_overrides(out[key], value) if nested else value
    return out


# the HF keys ``--hf-overrides`` can set on a config read from GGUF metadata alone (no HF config in between)
GGUF_OVERRIDABLE = {"num_hidden_layers": "num_layers", "max_position_embeddings": "max_position_embeddings",
                    "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps", "sliding_window": "sliding_window"}


def with_config_overrides(cfg: ModelConfig, overrides: dict | None, source: str) -> ModelConfig:
    """``cfg`` (read from GGUF metadata alone) with ``--hf-overrides`` of the keys in ``GGUF_OVERRIDABLE``; any
    other key is an error naming it (it would otherwise be silently dropped)."""
    if not overrides:
        return cfg
    unknown = sorted(set(overrides) - set(GGUF_OVERRIDABLE))
    if unknown:
        raise ModelLoadError(f"{source}: --hf-overrides {', '.join(unknown)} cannot apply: this GGUF file's "
                             f"config is read from its metadata, which takes only {', '.join(GGUF_OVERRIDABLE)}")
    return dataclasses.replace(cfg, **{GGUF_OVERRIDABLE[k]: v for k, v in overrides.items()})


def read_generation_config(folder: str) -> dict:
    """An HF model folder's ``generation_config.json``, or {}."""
    path = os.path.join(folder, "generation_config.json")
    return read_json(path) if os.path.exists(path) else {}


def model_config_from_folder(folder: str, hf_overrides: dict | None = None) -> tuple[ModelConfig, dict, dict]:
    """(ModelConfig, raw config.json with ``hf_overrides`` applied, generation_config.json or {}) of an HF model
    folder."""
    hf = with_hf_overrides(read_json(os.path.join(folder, "config.json")), hf_overrides)
    gen = read_generation_config(folder)
    return model_config_from_hf(hf, gen), hf, gen
