"""``LoadedModel``, what every weight source's loader returns, and the choices they make alike: the dtype the
weights are served in, the longest sequence, the generation config, and which sources take a quantization."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError

DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "half": jnp.float16, "fp16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Any                       # pytree of jax.Array (family.param_shapes structure)
    family: Any                       # the registry's family: forward / compute_logits / param_partition_specs
    tokenizer: Any                    # HF tokenizer
    chat_template: str | None
    generation_config: dict           # eos_token_id (list), bos_token_id, ...
    source: str                       # what was loaded: a path, or "dummy:<name>"
    dtype: Any = jnp.float32          # the parameters' dtype
    max_model_len: int = 2048
    load_format: str = "auto"
    quantization: str | None = None   # the method the projections are stored in (awq, gptq, fp8, ...)


def resolve_dtype(dtype: str | Any, default: Any) -> Any:
    if dtype in (None, "auto"):
        return default
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type


def config_dtype(hf: dict, fallback: Any) -> Any:
    """The dtype an HF config.json says its weights are in (``torch_dtype`` / ``dtype``), else ``fallback``."""
    name = hf.get("torch_dtype") or hf.get("dtype")
    return DTYPES.get(str(name).replace("torch.", ""), fallback) if name else fallback


def generation_config(cfg: ModelConfig, gen: dict | None = None) -> dict:
    out = dict(gen or {})
    out["eos_token_id"] = list(cfg.eos_token_ids)
    if cfg.bos_token_id is not None:
        out.setdefault("bos_token_id", cfg.bos_token_id)
    return out


def resolve_max_model_len(cfg: ModelConfig, limit: int | None) -> int:
    """The longest sequence served: ``limit``, at most the model's ``max_position_embeddings`` (its default)."""
    if limit is None:
        return cfg.max_position_embeddings
    if limit > cfg.max_position_embeddings:
        raise ModelLoadError(f"max_model_len {limit} is larger than the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
    return int(limit)


def float_only(quantization: str | None, what: str) -> None:
    """Refuse a quantization flag for a source whose weights are float (``what`` says which and why)."""
    if quantization not in (None, "auto", "none"):
        raise ModelLoadError(f"--quantization {quantization}: {what}; quantized loading reads HF safetensors "
                             f"checkpoints (or random weights with --load-format dummy)")
