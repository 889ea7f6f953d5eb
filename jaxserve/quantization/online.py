"""Quantizing float weights on the device: ``--quantization fp8`` of a float checkpoint (vLLM's online fp8:
per-output-channel scales) and the int4 / fp8 forms of random weights (``--load-format dummy``)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .weights import FP8_DTYPE, FP8_MAX, Fp8Weight, Int4Weight

PACK = 8


def quantize_fp8_per_channel(w: jax.Array) -> Fp8Weight:
    """``w [K, *out]`` → e4m3 with one float32 scale per output channel (max |w| over K maps to 448), stored
    output-major (``Fp8Weight``)."""
    wf = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=0), 1e-12) / FP8_MAX
    q = jnp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return Fp8Weight(weight=jnp.moveaxis(q, 0, -1), scale=scale, input_scale=None)


def quantize_int4(w: jax.Array, group_size: int, scale_dtype) -> Int4Weight:
    """``w [K, *out]`` → asymmetric int4 with zero points per group of ``group_size`` rows (round to nearest;
    what an AWQ checkpoint stores, without its activation-aware search)."""
    k = w.shape[0]
    g = w.astype(jnp.float32).reshape((k // group_size, group_size) + w.shape[1:])
    lo, hi = jnp.min(g, axis=1), jnp.max(g, axis=1)
    scale = jnp.maximum(hi - lo, 1e-12) / 15.0
    scale = scale.astype(scale_dtype).astype(jnp.float32)          # the zero point fits the stored scale
    zero = jnp.clip(jnp.round(-lo / scale), 0, 15)
    q = jnp.clip(jnp.round(g / scale[:, None]) + zero[:, None], 0, 15).astype(jnp.uint32)
    planes = q.reshape((k // PACK, PACK) + w.shape[1:])
    shifts = (4 * jnp.arange(PACK, dtype=jnp.uint32)).reshape((1, PACK) + (1,) * (w.ndim - 1))
    packed = jnp.sum(planes << shifts, axis=1, dtype=jnp.uint32)     # disjoint bits: the sum is an OR
    return Int4Weight(packed=jax.lax.bitcast_convert_type(packed, jnp.int32), scales=scale.astype(scale_dtype),
                      zeros=zero.astype(jnp.int8), perm=None, group_size=group_size)


@functools.lru_cache(maxsize=64)
def jitted(fn, out_shardings=None, **kw):
    """One compiled quantizer per (function, options, output shardings): a model compiles one per shape."""
    f = functools.partial(fn, **kw)
    return jax.jit(f, out_shardings=out_shardings) if out_shardings is not None else jax.jit(f)
