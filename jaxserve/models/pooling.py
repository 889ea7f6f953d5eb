"""How an embedding model turns hidden states into one vector: pooling, normalization, `dimensions`.

The pooling recipe is read from the sentence-transformers files next to the weights (``modules.json``,
``1_Pooling/config.json``, a ``sentence_transformers.models.Normalize`` entry), as sentence-transformers
itself does. Without them the family default applies (encoders: mean + normalize, decoders: last token +
normalize, as vLLM does) and ``PoolingConfig.source`` says so.

Device side: ``pool_padded`` ([B, S, H] hidden + [B] lengths, right padded) and ``pool_ragged`` (flat
[T, H] tokens of a ragged step). Host side: ``postprocess`` (``dimensions`` truncation, then L2 norm).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

POOLING_TYPES = ("mean", "cls", "last")

# sentence-transformers' Pooling flags -> our names. Flags we do not implement are rejected at load.
_ST_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str = "mean"            # mean | cls | last
    normalize: bool = True                # L2-normalize the pooled vector (the model's default)
    # Matryoshka: the model was trained so that a prefix of its embedding is itself an embedding.
    # Only then may a request ask for fewer `dimensions` (vLLM rejects it otherwise).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None   # allowed sizes, None = any prefix
    source: str = "default"               # where the recipe came from (shown in logs / reports)

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {self.pooling_type!r} is not one of {POOLING_TYPES}")


def read_pooling_config(model_dir: str, *, default_pooling: str = "mean", default_normalize: bool = True,
                        hf_config: dict | None = None) -> PoolingConfig:
    """The pooling recipe of the model in ``model_dir`` (sentence-transformers files, else the default).

    Matryoshka support comes from HF ``config.json`` (``is_matryoshka`` / ``matryoshka_dimensions``,
    the keys vLLM reads); pass it as ``hf_config`` or it is read from ``model_dir``.
    """
    if hf_config is None:
        hf_config = _read_json(os.path.join(model_dir, "config.json")) or {}
    dims = hf_config.get("matryoshka_dimensions")
    matryoshka = dict(is_matryoshka=bool(hf_config.get("is_matryoshka") or dims),
                      matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)

    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if modules is None:
        logger.warning("%s has no sentence-transformers modules.json: using %s pooling%s (the default)",
                       model_dir, default_pooling, " + normalize" if default_normalize else "")
        return PoolingConfig(default_pooling, default_normalize, **matryoshka,
                             source=f"default ({default_pooling}{', normalize' if default_normalize else ''};"
                                    " no modules.json)")

    pooling_type, normalize = default_pooling, False
    pooling_source = "default (no Pooling module)"
    for module in modules:
        kind = module.get("type", "")
        if kind == _ST_TRANSFORMER:
            continue
        if kind == _ST_NORMALIZE:
            normalize = True    # Normalize has no config; its folder need not exist
        elif kind == _ST_POOLING:
            path = os.path.join(model_dir, module.get("path", ""), "config.json")
            pooling_type = _pooling_type_from_st(path)
            pooling_source = os.path.relpath(path, model_dir)
        else:
            raise ModelLoadError(f"{model_dir}/modules.json uses the sentence-transformers module {kind!r}, "
                                 "which jaxserve does not implement (supported: Transformer, Pooling, Normalize)")
    return PoolingConfig(pooling_type, normalize, **matryoshka,
                         source=f"modules.json + {pooling_source}")


def _pooling_type_from_st(path: str) -> str:
    cfg = _read_json(path)
    if cfg is None:
        raise ModelLoadError(f"modules.json names a Pooling module but {path} is missing")
    if cfg.get("pooling_mode"):      # newer sentence-transformers write the mode as one string
        mode = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(cfg["pooling_mode"])
        if mode is None:
            raise ModelLoadError(f"{path}: pooling_mode {cfg['pooling_mode']!r} is not supported "
                                 "(supported: mean, cls, lasttoken)")
        return mode
    bad = [k for k in _ST_UNSUPPORTED_FLAGS if cfg.get(k)]
    modes = [name for flag, name in _ST_POOLING_FLAGS.items() if cfg.get(flag)]
    if bad or len(modes) != 1:
        raise ModelLoadError(f"{path}: jaxserve supports exactly one of mean / cls / lasttoken pooling, "
                             f"the file enables {[k for k in cfg if k.startswith('pooling_mode') and cfg[k]]}")
    return modes[0]


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


# ----------------------------------------------------------------------------------------- device side
def pool_padded(hidden: jax.Array, lengths: jax.Array, pooling_type: str) -> jax.Array:
    """Pool right-padded ``hidden [B, S, H]`` with real lengths ``[B]`` -> float32 ``[B, H]``.

    Rows of length 0 (padding rows of a bucket) give finite junk; callers drop them.
    """
    hidden = hidden.astype(jnp.float32)
    if pooling_type == "cls":
        return hidden[:, 0]
    if pooling_type == "last":
        idx = jnp.maximum(lengths - 1, 0)
        return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    if pooling_type == "mean":
        mask = (jnp.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)
        total = jnp.einsum("bsh,bs->bh", hidden, mask)
        return total / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None]
    raise ValueError(f"unknown pooling_type {pooling_type!r}")


def pool_ragged(hidden: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array,
                pooling_type: str) -> jax.Array:
    """Pool flat ``hidden [T, H]`` where sequence r owns tokens ``query_start_loc[r]:[r+1]`` -> ``[R, H]``.

    Used for decoders run through the ragged step (one prefill chunk per sequence, whole prompts).
    """
    hidden = hidden.astype(jnp.float32)
    R = query_start_loc.shape[0] - 1
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    lengths = ends - starts
    if pooling_type == "cls":
        return hidden[jnp.clip(starts, 0, hidden.shape[0] - 1)]
    if pooling_type == "last":
        return hidden[jnp.clip(ends - 1, 0, hidden.shape[0] - 1)]
    if pooling_type == "mean":
        t = jnp.arange(hidden.shape[0], dtype=jnp.int32)
        seq = jnp.searchsorted(ends, t, side="right")       # tokens past the last real one -> R (dropped)
        seq = jnp.where(t < query_start_loc[num_seqs], seq, R)
        total = jax.ops.segment_sum(hidden, seq, num_segments=R)
        return total / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None]
    raise ValueError(f"unknown pooling_type {pooling_type!r}")


# ------------------------------------------------------------------------------------------- host side
def check_dimensions(dimensions: int | None, hidden_size: int, pooling: PoolingConfig, model_name: str = "model"):
    """Raise ``InvalidRequestError`` (HTTP 400) unless ``dimensions`` is allowed for this model."""
    if dimensions is None:
        return
    if not pooling.is_matryoshka:
        raise InvalidRequestError(
            f"{model_name} does not support matryoshka representation, so `dimensions` cannot be set "
            "(truncating its embeddings would give poor results)", param="dimensions")
    if not 1 <= dimensions <= hidden_size:
        raise InvalidRequestError(f"dimensions is {dimensions}; it must be between 1 and the embedding size "
                                  f"{hidden_size}", param="dimensions")
    allowed = pooling.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise InvalidRequestError(f"dimensions is {dimensions}; {model_name} supports only {list(allowed)}",
                                  param="dimensions")


def postprocess(pooled: np.ndarray, *, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Matryoshka truncation, then L2 normalization (so a truncated vector is renormalized)."""
    v = np.asarray(pooled, dtype=np.float32)
    if dimensions is not None:
        v = v[..., :dimensions]
    if normalize:
        # sentence-transformers' Normalize: x / max(||x||, 1e-12)
        v = v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
    return v
