"""The three norms of the decoder families, each exactly as HF transformers computes it.

- ``rms_norm`` (Llama, Qwen, Phi-3): statistics in float32, the normalised value cast back to the input dtype
  *before* the weight multiply.
- ``offset_rms_norm`` (Gemma): ``(1 + w)`` times the normalised value, the multiply in float32, then the cast.
- ``layer_norm`` (Command-R): mean-centred, no bias, weight multiply in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis in float32, kept as a size-1 axis: the statistic of
    both RMSNorms, which a caller may compute once for several arrays' rows (``inv`` below)."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, inv: jax.Array | None = None) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * (inv_rms(xf, eps) if inv is None else inv)
    return weight * normed.astype(x.dtype)


def offset_rms_norm(x: jax.Array, weight: jax.Array, eps: float, inv: jax.Array | None = None) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * (inv_rms(xf, eps) if inv is None else inv)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


NORMS = {"rms": rms_norm, "offset_rms": offset_rms_norm, "layer": layer_norm}
