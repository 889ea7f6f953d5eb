"""W4A16 matmul with the dequantization fused into the kernel (Pallas, Triton lowering), and its jnp reference.

The weight layout (``jaxserve.quantization``'s ``Int4Weight``, which every int4 checkpoint format is repacked
into at load): ``packed`` int32 ``[K/8, N]`` whose nibble ``j`` (bits ``4j..4j+3``) of row ``r`` is the unsigned
4-bit value of input row ``8r + j``; ``scales`` ``[K/G, N]`` (float) and ``zeros`` ``[K/G, N]`` (int8, 0..15)
per group of ``G`` input rows: ``w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``.

Why this layout: packing along K keeps every output column's bytes together (a program streams whole columns
of its tile) and lets tensor parallelism split K or N at any group boundary. The kernel does not need to
interleave rows: nibble plane ``j`` of a packed tile holds rows ``j, j + 8, ...``, so it multiplies the
stride-8 columns ``j, j + 8, ...`` of ``x`` (a strided load of the small activation) and every dot is a plain
2-D tile product.

The kernel: a program owns ``bm`` rows of ``x`` and ``bn`` output columns, and walks its share of K (split
``split_k`` ways when too few tiles would fill the GPU: decode shapes) in steps of ``bk`` rows that never
cross a group, so one scale/zero row serves the step. Each step loads ``[bk/8, bn]`` int32 once, unpacks the
8 nibble planes in registers into the activation dtype and accumulates 8 dots in float32. Triton's dot needs
16 rows of ``x`` (decode pads to 16: free, the kernel is bound by weight bytes) and a K of at least 16
(``bk >= 128``): groups of 32 or 64 run through ``int4_matmul_reference`` on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

PACK = 8          # int4 values per int32
NUM_SMS = 132     # H200: the split-K heuristic aims at a couple of programs per SM


def unpack_int4(packed: jax.Array) -> jax.Array:
    """``[K/8, ...]`` int32 → ``[K, ...]`` int32 values 0..15 (row ``8r + j`` from nibble ``j`` of row ``r``)."""
    shifts = (4 * jnp.arange(PACK, dtype=jnp.int32)).reshape((1, PACK) + (1,) * (packed.ndim - 1))
    q = (packed[:, None] >> shifts) & 15
    return q.reshape((packed.shape[0] * PACK,) + packed.shape[1:])


def dequantize_int4(packed: jax.Array, scales: jax.Array, zeros: jax.Array, group_size: int,
                    dtype=jnp.float32) -> jax.Array:
    """The float weight ``[K, ...]``: ``(q - zero) * scale`` in float32, then cast to ``dtype``."""
    q = unpack_int4(packed).astype(jnp.float32)
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    z = jnp.repeat(zeros.astype(jnp.float32), group_size, axis=0)
    return ((q - z) * s).astype(dtype)


def int4_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array,
                          group_size: int) -> jax.Array:
    """``x [M, K] @ w [K, N]`` with ``w`` dequantized to ``x``'s dtype first; float32 accumulation."""
    w = dequantize_int4(packed, scales, zeros, group_size, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def supports(m: int, k: int, n: int, group_size: int, *, interpret: bool = False) -> bool:
    """Whether ``int4_matmul`` runs this shape (else use the reference)."""
    bk = _block_k(group_size)
    if k % bk or _block_n(n) is None:
        return False
    return interpret or bk // PACK >= 16


def _block_k(group_size: int) -> int:
    """K rows per kernel step: the group, or 128-row slices of a larger group (per-channel: G = K)."""
    return 128 if group_size % 128 == 0 else group_size


def _block_n(n: int) -> int | None:
    return next((b for b in (64, 32, 16) if n % b == 0), None)


def _kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, bm, bn, bk, group_size, k_steps):
    m, n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = pl.ds(m * bm, bm), pl.ds(n * bn, bn)
    kp = bk // PACK

    def step(i, acc):
        k0 = (split * k_steps + i) * bk
        g = k0 // group_size
        p = p_ref[pl.ds(k0 // PACK, kp), cols]
        s = s_ref[pl.ds(g, 1), cols].astype(jnp.float32)
        z = z_ref[pl.ds(g, 1), cols].astype(jnp.float32)
        for j in range(PACK):
            w = ((((p >> (4 * j)) & 15).astype(jnp.float32) - z) * s).astype(x_ref.dtype)
            xj = x_ref[rows, pl.ds(k0 + j, kp, stride=PACK)]
            acc += jnp.dot(xj, w, preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, k_steps, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[split, rows, cols] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "block_n", "split_k", "num_warps", "num_stages",
                                             "interpret"))
def int4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array, *, group_size: int,
                block_n: int | None = None, split_k: int | None = None, num_warps: int = 4,
                num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """``x [M, K] @ w [K, N]`` for the int4 weight ``(packed, scales, zeros)``; the result in ``x``'s dtype."""
    m, k = x.shape
    n = packed.shape[1]
    bk = _block_k(group_size)
    bn = block_n or _block_n(n)
    assert k % bk == 0 and n % bn == 0 and packed.shape[0] * PACK == k, (x.shape, packed.shape, group_size)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    mp = -(-m // bm) * bm
    k_blocks = k // bk
    if split_k is None:       # fill the GPU at decode shapes: about two programs per SM
        tiles = (mp // bm) * (n // bn)
        want = max(1, -(-2 * NUM_SMS // tiles))
        split_k = max(d for d in range(1, k_blocks + 1) if k_blocks % d == 0 and d <= want)
    assert k_blocks % split_k == 0, (k_blocks, split_k)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    out_dtype = x.dtype if split_k == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn, bk=bk, group_size=group_size, k_steps=k_blocks // split_k),
        grid=(mp // bm, n // bn, split_k),
        out_shape=jax.ShapeDtypeStruct((split_k, mp, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_matmul")(xp, packed, scales, zeros)
    out = out[0] if split_k == 1 else out.sum(0).astype(x.dtype)
    return out[:m]
