"""Random weights for ``--load-format dummy``, made on the device where each lives (``DecoderFamily.
init_dummy_params``): a jitted fill per (init kind, shape, dtype, sharding), its values a hash of each element's
index and the weight's seed, so the same model holds the same weights on any mesh."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

DUMMY_STD = 0.02
_U32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (xor-shift / multiply finaliser): neighbouring inputs give unrelated outputs.
    Works on Python ints and on uint32 arrays alike."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32 if isinstance(x, int) else x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32 if isinstance(x, int) else x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def leaf_seed(seed: int, index: int) -> np.uint32:
    """A host scalar: it rides along with the fill's dispatch (a device scalar per weight is a device op each)."""
    return np.uint32(_mix32((_mix32(seed & _U32) + index * 0x9E3779B9) & _U32))


@functools.lru_cache(maxsize=64)
def dummy_init_fn(kind: str, shape: tuple, dtype, sharding):
    """One jitted generator per (kind, shape, dtype, sharding), the seed an argument: a 32-layer model
    compiles ~8 programs, not ~290.

    Why a hash of each element's index and not ``jax.random``: the fill is elementwise on iotas, so XLA
    writes each shard where it lives at memory speed (threefry plus the normal's inverse erf cost far more
    per element), and the values do not depend on the sharding: a model split over any mesh holds the
    same weights."""
    if kind in ("ones", "zeros"):
        fill = jnp.ones if kind == "ones" else jnp.zeros
        return jax.jit(lambda seed: fill(shape, dtype), out_shardings=sharding)
    half_width = DUMMY_STD * 3 ** 0.5          # uniform(-a, a) has std a / sqrt(3)

    def uniform(seed):
        if not shape:
            return jnp.zeros(shape, dtype)
        # element (..., c) hashes its row (every axis but the last, flattened) with the seed, then its
        # column: uint32 throughout, so no index overflows for any weight shape
        row = jnp.zeros(shape, jnp.uint32)
        stride = 1
        for axis in range(len(shape) - 2, -1, -1):
            row = row + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride & _U32)
            stride *= shape[axis]
        col = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
        bits = _mix32(_mix32(row ^ seed) + col * jnp.uint32(0x9E3779B9))
        u = (bits >> 8).astype(jnp.float32) * (2.0 ** -24)                 # [0, 1), 24 bits
        return ((2 * u - 1) * half_width).astype(dtype)
    return jax.jit(uniform, out_shardings=sharding)
