"""The projections' matmul: a float ``[in, *out]`` weight, or a quantized one (``jaxserve.quantization``)
that replaced it in the weight tree. The decoder calls these instead of ``@`` so a family's code is the same
for both."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve import parallel
from jaxserve.quantization import Fp8Activation, is_quantized, matmul, reads_fp8_activations, rms_norm_fp8

from .norms import rms_norm


def linear(x: jax.Array, w) -> jax.Array:
    """``x [T, K]`` times a column-parallel (or replicated) weight ``w [K, *out]`` → ``[T, *out]``."""
    if is_quantized(w):
        return matmul(x, w)
    if w.ndim == 2:
        return x @ w
    return jnp.einsum("th,hci->tci", x, w)     # gate_up [hidden, 2, inter]



def unmerged(h, n: int) -> tuple:
    """``n`` uses of the normed input ``h`` that XLA cannot tell apart from each other's: for an fp8 activation
    (``Fp8Activation``, read by the q, k and v fp8 dots) an optimization barrier, because XLA's GPU dot merger
    merges dots of one shared operand whose weights are small enough (fp8 q, k and v at the 8B shape, not their
    bf16 ones) into one dot over the weights concatenated anew every step: 24 MiB read and written a layer.
    Other inputs are returned as they are."""
    if not isinstance(h, Fp8Activation):
        return (h,) * n
    return (h, *jax.lax.optimization_barrier((h,) * (n - 1)))

def row_parallel_linear(x: jax.Array, w) -> jax.Array:
    """``x @ w`` for a row-parallel weight (o, down), summed over ``"tp"``."""
    if is_quantized(w):
        return matmul(x, w)
    return parallel.row_parallel_matmul(x, w)


def normed_input(x: jax.Array, norm: Callable, norm_weight: jax.Array, eps: float, readers=()):
    """``norm(x, norm_weight, eps)`` as the projections ``readers`` take it: quantized once, inside the norm's
    kernels, when they are all fp8 W8A8 (else each would quantize it again before its GEMM)."""
    if norm is rms_norm and reads_fp8_activations(readers, x.shape[0]):
        return rms_norm_fp8(x, norm_weight, eps)
    return norm(x, norm_weight, eps)


def row_parallel_linear_add_rms_norm(x: jax.Array, w, residual: jax.Array, norm_weight: jax.Array, eps: float,
                                     norm: Callable, readers=()) -> tuple[jax.Array, jax.Array]:
    """``(s, rms_norm(s))`` with ``s = residual + x @ w`` (the fused TP all-reduce for float weights); the norm
    as ``readers`` take it (``normed_input``)."""
    if is_quantized(w):
        s = residual + matmul(x, w)
        return s, normed_input(s, norm, norm_weight, eps, readers)
    return parallel.row_parallel_matmul_add_rms_norm(x, w, residual, norm_weight, eps, norm)
