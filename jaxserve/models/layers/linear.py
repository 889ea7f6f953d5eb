"""The projections' matmul: a float ``[in, *out]`` weight, or a quantized one (``jaxserve.quantization``)
that replaced it in the weight tree. The decoder calls these instead of ``@`` so a family's code is the same
for both."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve import parallel
from jaxserve.quantization import is_quantized, matmul


def linear(x: jax.Array, w) -> jax.Array:
    """``x [T, K]`` times a column-parallel (or replicated) weight ``w [K, *out]`` → ``[T, *out]``."""
    if is_quantized(w):
        return matmul(x, w)
    if w.ndim == 2:
        return x @ w
    return jnp.einsum("th,hci->tci", x, w)     # gate_up [hidden, 2, inter]


def row_parallel_linear(x: jax.Array, w) -> jax.Array:
    """``x @ w`` for a row-parallel weight (o, down), summed over ``"tp"``."""
    if is_quantized(w):
        return matmul(x, w)
    return parallel.row_parallel_matmul(x, w)


def row_parallel_linear_add_rms_norm(x: jax.Array, w, residual: jax.Array, norm_weight: jax.Array, eps: float,
                                     rms_norm: Callable) -> tuple[jax.Array, jax.Array]:
    """``(s, rms_norm(s))`` with ``s = residual + x @ w`` (the fused TP all-reduce for float weights)."""
    if is_quantized(w):
        s = residual + matmul(x, w)
        return s, rms_norm(s, norm_weight, eps)
    return parallel.row_parallel_matmul_add_rms_norm(x, w, residual, norm_weight, eps, rms_norm)
