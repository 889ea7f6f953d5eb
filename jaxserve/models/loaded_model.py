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


def with_fused_qkv(cfg: ModelConfig, family: Any, quant, mesh) -> ModelConfig:
    """``cfg`` with q, k and v loaded as one ``qkv`` weight (``layers.decoder.FUSED_QKV``) where that makes one
    quantized GEMM a layer of three: XLA merges the three bf16 dots of one input itself, but not three int4 custom
    calls, each with a fixed cost at decode sizes (benchmarks/results/2026-12-06-h200-llama8b-decode-profile.md).
    Only for int4 without act-order (AWQ, GPTQ) and fp8 with dynamic activation scales (a static one per module
    would have to become their largest) whose 128 × 128 blocks end where each module does; without a mesh (a
    column split of the joined weight would not line up with the head shards); for a decoder whose q, k and v
    are plain projections. ``JAXSERVE_FUSED_QKV=0`` keeps three."""
    from jaxserve import envs
    from jaxserve.models.layers.decoder import FUSED_QKV
    if not envs.JAXSERVE_FUSED_QKV or quant is None or mesh is not None:
        return cfg
    if quant.weights == "int4" and (quant.desc_act or quant.method not in ("awq", "gptq")):
        return cfg
    outs = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    block_cut = quant.fp8_scales == "block" and any(n % 128 for n in outs)
    if quant.weights == "fp8" and (quant.activation_scheme != "dynamic" or block_cut):
        return cfg
    fused = dataclasses.replace(cfg, extra=tuple(sorted({**dict(cfg.extra), FUSED_QKV: True}.items())))
    try:        # every layer's qkv built from its three checkpoint tensors (not MLA, not Phi-3's fused rows)
        built = {path[1] for path, _, build in family.weight_plan(fused) if path[-1] == "qkv" and build == "cat_t"}
    except (AttributeError, KeyError, TypeError, AssertionError):
        return cfg
    return fused if built == set(range(cfg.num_layers)) else cfg
