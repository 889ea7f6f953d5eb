"""Pure-jnp paged attention: the CPU path and the oracle every Pallas kernel is tested against.

Cache layout, per layer: ``k_cache`` and ``v_cache`` each ``[num_blocks, kv_heads, block_size, head_dim]``
(head-major pages: one head's rows of a page are contiguous; ``kernels/ops.py`` says why), except that an fp8
cache stores its V pages transposed, ``[num_blocks, kv_heads, head_dim, block_size]`` (``v_transposed``); a
token's flat slot is ``block * block_size + offset``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .metadata import AttentionMetadata

# The oracle computes in true float32: XLA's default f32 matmul on GPU is TF32 (~1e-3 relative error).
HIGHEST = jax.lax.Precision.HIGHEST


FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)   # 448


def head_scale(scale, kv_heads: int):
    """A per-tensor (scalar) or per-head ``[kv_heads]`` scale as a ``[kv_heads]`` float32 vector."""
    if scale is None:
        return jnp.ones((kv_heads,), jnp.float32)
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (kv_heads,))


def v_transposed(cache_dtype) -> bool:
    """Whether a V cache of this dtype stores its pages transposed, ``[num_blocks, kv_heads, head_dim,
    block_size]`` (a page's keys contiguous per feature): fp8 (1-byte) caches do. The Pallas kernel's P.V then
    takes V^T as the matmul's K-major operand, as QK^T takes K, so 8-bit V needs no transpose on its way to
    the MMA (fp8 decode measured faster than over head-major V pages). bf16 V keeps head-major pages, which
    the Mosaic GPU prefill TMA-loads."""
    return jnp.dtype(cache_dtype).itemsize == 1


def quantize_kv(x, cache_dtype, scale):
    """Cast keys/values with kv heads on axis 1 -- a step's new ``[T, kv_heads, D]``, or a whole cache
    ``[num_blocks, kv_heads, block_size, D]`` -- to the cache dtype; fp8 divides by the scale and saturates."""
    if cache_dtype != FP8_DTYPE:
        return x.astype(cache_dtype)
    s = head_scale(scale, x.shape[1]).reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.clip(x.astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(cache_dtype)


def dequantize_kv(x, scale):
    """Cache values ``[..., kv_heads, D]`` back to float32 (times the per-head scale)."""
    return x.astype(jnp.float32) * head_scale(scale, x.shape[-2])[:, None]


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None):
    """Scatter the step's new keys/values ``[T, kv_heads, head_dim]`` into their cache slots.

    Meant to run on a donated cache so XLA updates it in place. An fp8 (e4m3) cache stores
    ``x / scale`` saturated to +-448; ``k_scale``/``v_scale`` are scalars or ``[kv_heads]`` (None = 1).
    """
    bs = k_cache.shape[2]
    blk, off = slot_mapping // bs, slot_mapping % bs
    # advanced indices around slices: the indexed view is [T, kv_heads, head_dim], like k and v
    vq = quantize_kv(v, v_cache.dtype, v_scale)
    return (k_cache.at[blk, :, off].set(quantize_kv(k, k_cache.dtype, k_scale)),
            v_cache.at[blk, :, :, off].set(vq) if v_transposed(v_cache.dtype) else v_cache.at[blk, :, off].set(vq))


def token_layout(md: AttentionMetadata, num_tokens: int):
    """For each flat token: its request index, its absolute position and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = md.query_start_loc
    num_reqs = md.block_tables.shape[0]
    req = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, num_reqs - 1).astype(jnp.int32)
    valid = t < qsl[md.num_seqs]
    q_len = qsl[req + 1] - qsl[req]
    qpos = md.seq_lens[req] - q_len + (t - qsl[req])
    return req, qpos, valid


def _token_rows(pages, transposed=False):
    """Gathered pages ``[T, c, kv_heads, block_size, D]`` (``transposed``: ``[T, c, kv_heads, D, block_size]``)
    as ``[T, c * block_size, kv_heads, D]``."""
    if transposed:
        pages = jnp.swapaxes(pages, 3, 4)
    T, c, kvh, bs, d = pages.shape
    return pages.transpose(0, 1, 3, 2, 4).reshape(T, c * bs, kvh, d)


def ragged_paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           k_scale=None, v_scale=None, pages_per_step: int = 8):
    """Attention of ``q [T, q_heads, head_dim]`` over each token's request context in the paged cache.

    Causal within the step's new tokens (and up to ``md.attend_limit`` where it is further); GQA by grouping
    q heads over kv heads. Computed in float32 with
    an online softmax over chunks of ``pages_per_step`` pages, so memory stays ``O(T * chunk)``.
    Padding tokens return zeros. ``k_scale``/``v_scale`` dequantize an fp8 cache (see ``write_kv``).
    """
    T, hq, d = q.shape
    _, kvh, bs, _ = k_cache.shape
    R, P = md.block_tables.shape
    g = hq // kvh
    c = max(1, min(pages_per_step, P))
    n_chunks = -(-P // c)
    tables = jnp.pad(md.block_tables, ((0, 0), (0, n_chunks * c - P)))
    tables = tables.reshape(R, n_chunks, c).transpose(1, 0, 2)          # [n_chunks, R, c]

    req, qpos, valid = token_layout(md, T)
    klen = jnp.where(valid, md.seq_lens[req], 0)                          # [T]
    qlim = qpos if md.attend_limit is None else jnp.maximum(qpos, md.attend_limit)   # last key each token sees
    qg = q.astype(jnp.float32).reshape(T, kvh, g, d) * sm_scale
    offs = jnp.arange(c * bs, dtype=jnp.int32)

    def chunk(carry, xs):
        m, l, acc = carry
        i, tab = xs                                                        # tab [R, c]
        blk = tab[req]                                                     # [T, c]
        kb = dequantize_kv(_token_rows(k_cache[blk]), k_scale)            # [T, c*bs, kvh, d]
        vb = dequantize_kv(_token_rows(v_cache[blk], v_transposed(v_cache.dtype)), v_scale)
        s = jnp.einsum("thgd,tkhd->thgk", qg, kb, precision=HIGHEST)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = i * c * bs + offs                                           # [c*bs]
        mask = (kpos[None, :] <= qlim[:, None]) & (kpos[None, :] < klen[:, None])
        if sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,tkhd->thgd", p, vb, precision=HIGHEST)
        return (m_new, l, acc), None

    init = (jnp.full((T, kvh, g), -jnp.inf, jnp.float32), jnp.zeros((T, kvh, g), jnp.float32),
            jnp.zeros((T, kvh, g, d), jnp.float32))
    # Loop only over the chunks the longest context in this step reaches (a dynamic trip count), so cost
    # follows the real context, not the block table's padded width.
    n_live = jnp.minimum((jnp.max(klen) + c * bs - 1) // (c * bs), n_chunks)
    m, l, acc = jax.lax.fori_loop(0, n_live, lambda i, carry: chunk(carry, (i, tables[i]))[0], init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(T, hq, d).astype(q.dtype)


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's ``(k_cache, v_cache)`` stored in ``dtype``: head-major pages ``[num_blocks,
    kv_heads, block_size, head_dim]``, except that an fp8 cache's V pages are transposed, ``[num_blocks,
    kv_heads, head_dim, block_size]`` (``v_transposed`` says why). When ``head_dim ==
    block_size`` the two V layouts have the same shape: the dtype alone says which one a cache holds.

    Head-major pages: one head's ``block_size`` rows of a page are one contiguous run (4 KiB in bf16 at d=128,
    pages of 16), where token-major pages ``[blocks, block, kv_heads, d]`` scatter them ``kv_heads * d``
    apart; same output, and the decode kernel reads head-major pages faster.
    """
    k_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if v_transposed(dtype):
        return k_shape, (num_blocks, num_kv_heads, head_dim, block_size)
    return k_shape, k_shape
