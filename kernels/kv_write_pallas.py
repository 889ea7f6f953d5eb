"""The step's new K and V into the paged cache in one Pallas (Triton) launch: ``write_kv`` for NVIDIA GPUs.

Same function as ``ref_attention.write_kv`` over the cache layout ``[num_blocks, kv_heads, block_size,
head_dim]`` (an fp8 cache's V pages transposed, ``[num_blocks, kv_heads, head_dim, block_size]``), except
that padding tokens (``slot_mapping == PAD_SLOT``, the null block) write nothing. One
program per token copies its ``kv_heads`` rows of K and of V (quantizing to e4m3 for an fp8 cache) into the
caches, all heads in one ``[kv_heads, head_dim]`` load and one masked store per tensor; the caches are aliased to
the outputs so the donated cache is updated in place. ``write_kv_packed`` reads K and V from the one
``[T, q heads + 2 * kv heads, D]`` array the layer also hands the attention kernel (``ops.write_kv_and_attend``).
All heads at once, not one row per head in sequence: a decode step's launch is latency-bound, and one masked
block per tensor takes less than half the time of a chain of per-head rows (kernels/README.md).

Why not XLA's scatter: a layer's two scatters (K, V) are two launches, and under tensor parallelism they were
a large share of each device's kernel time in a decode step; this kernel writes both in one launch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .metadata import PAD_SLOT
from .triton_rows import next_pow2, rows_of
from .ref_attention import FP8_DTYPE, FP8_MAX, head_scale, kv_cache_shapes, v_transposed


def _write_kernel(slots_ref, ks_ref, vs_ref, k_ref, v_ref, _kc_in, _vc_in, kc_ref, vc_ref, *, kvh, bs, stride,
                  k_off, v_off, v_transposed):
    """Token t's K heads are rows ``t * stride + k_off + h`` of ``k_ref``, its V heads the same from ``v_off``
    in ``v_ref`` (separate k / v: stride kvh, offsets 0; one packed q/k/v array: both refs are it).
    ``v_transposed`` (fp8): ``vc_ref`` is the V cache seen as ``[num_blocks * kvh * D, bs]``, and the token's
    ``[kvh, D]`` values go to column ``slot % bs`` of rows ``(block * kvh + h) * D + d``."""
    t = pl.program_id(0)
    slot = slots_ref[t]
    page_row = (slot // bs) * kvh * bs + slot % bs          # head h's row: page_row + h * bs
    heads = lax.iota(jnp.int32, next_pow2(kvh))            # Triton blocks are powers of two: rows >= kvh masked

    @pl.when(slot != PAD_SLOT)
    def _():
        real = heads < kvh
        hh = jnp.minimum(heads, kvh - 1)                    # padded rows re-read the last head, never stored
        # a padded row's (masked) store points at row 0 (the null block, which no token writes), not at a
        # real row: interpret mode stores a masked row's old value back, which must not undo a real store
        dst_rows = jnp.where(real, page_row + heads * bs, 0)
        d = k_ref.shape[1]
        keep = jnp.broadcast_to(real[:, None], (heads.shape[0], d))
        for src, off, scale_ref, dst in ((k_ref, k_off, ks_ref, kc_ref), (v_ref, v_off, vs_ref, vc_ref)):
            x = plgpu.load(rows_of(src, t * stride + off + hh))                     # [kvh_pad, D]
            if dst.dtype == FP8_DTYPE:
                scale = plgpu.load(scale_ref.at[hh])
                x = jnp.clip(x.astype(jnp.float32) / scale[:, None], -FP8_MAX, FP8_MAX)
            if v_transposed and dst is vc_ref:      # one element per (head, feature), a column of the page
                head_base = jnp.where(real, (slot // bs) * kvh + heads, 0) * d        # padded rows: the null block
                feat_rows = head_base[:, None] + lax.iota(jnp.int32, d)[None, :]      # [kvh_pad, D]
                col = jnp.broadcast_to(jnp.where(real, slot % bs, 0)[:, None], feat_rows.shape)
                plgpu.store(dst.at[feat_rows, col], x.astype(dst.dtype), mask=keep)
            else:
                plgpu.store(rows_of(dst, dst_rows), x.astype(dst.dtype), mask=keep)


def _launch(k_cache, v_cache, k_src, v_src, slot_mapping, *, stride, k_off, v_off, k_scale, v_scale, interpret):
    """One program per token: ``k_src``/``v_src`` hold ``stride`` rows per token (see ``_write_kernel``)."""
    nb, kvh, bs, d = k_cache.shape
    T = k_src.shape[0] // stride
    flat = (nb * kvh * bs, d)
    vt = v_transposed(v_cache.dtype)
    v_flat = (nb * kvh * d, bs) if vt else flat
    if tuple(v_cache.shape) != kv_cache_shapes(nb, bs, kvh, d, v_cache.dtype)[1]:
        raise ValueError(f"V cache shape {v_cache.shape} does not match K's {k_cache.shape} in {v_cache.dtype} "
                         f"(ref_attention.kv_cache_shapes)")
    kc, vc = pl.pallas_call(
        functools.partial(_write_kernel, kvh=kvh, bs=bs, stride=stride, k_off=k_off, v_off=v_off, v_transposed=vt),
        grid=(T,),
        out_shape=(jax.ShapeDtypeStruct(flat, k_cache.dtype), jax.ShapeDtypeStruct(v_flat, v_cache.dtype)),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="paged_kv_write",
    )(slot_mapping.astype(jnp.int32), head_scale(k_scale, kvh), head_scale(v_scale, kvh),
      k_src, v_src, k_cache.reshape(flat), v_cache.reshape(v_flat))
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None, interpret: bool = False):
    """``ref_attention.write_kv`` (same arguments and result, padding tokens skipped) in one launch.
    In place when the caller's jit donates the caches (the engine's step does); otherwise XLA copies them."""
    T, kvh, d = k.shape
    return _launch(k_cache, v_cache, k.reshape(T * kvh, d), v.reshape(T * kvh, d), slot_mapping,
                   stride=kvh, k_off=0, v_off=0, k_scale=k_scale, v_scale=v_scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "interpret"))
def write_kv_packed(k_cache, v_cache, qkv, slot_mapping, *, num_q_heads: int, k_scale=None, v_scale=None,
                    interpret: bool = False):
    """``write_kv`` of the K and V packed behind the queries in ``qkv [T, num_q_heads + 2 * kv_heads, D]``
    (heads ``[hq, hq + kvh)`` are K, the next ``kvh`` V): one operand, which the attention kernel reads too."""
    T, H, d = qkv.shape
    kvh = k_cache.shape[1]
    if H != num_q_heads + 2 * kvh:
        raise ValueError(f"qkv has {H} heads, expected {num_q_heads} q + 2 x {kvh} kv heads")
    flat = qkv.reshape(T * H, d)
    return _launch(k_cache, v_cache, flat, flat, slot_mapping, stride=H, k_off=num_q_heads,
                   v_off=num_q_heads + kvh, k_scale=k_scale, v_scale=v_scale, interpret=interpret)
