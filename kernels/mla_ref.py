"""Pure-jnp multi-head latent attention (DeepSeek's MLA) over a paged latent cache: the CPU path and the oracle
the Pallas MLA kernel (``mla_decode_pallas``) is tested against.

Cache layout, per layer: ``latent_cache [num_blocks, block_size, R + P]``, one row per token: the normed
compressed KV ``c_kv`` (``R = kv_lora_rank`` values) then the rotated shared key ``k_rope`` (``P =
qk_rope_head_dim``); a token's flat slot is ``block * block_size + offset`` as in ``ref_attention``. Every head
reads the same row (MQA with an ``R + P``-wide key and an ``R``-wide value).

Weight absorption: the caller folds ``kv_b_proj``'s key half into the queries (``q_nope_latent = q_nope · W_UK``),
so the scores are ``q_nope_latent · c_kv + q_rope · k_rope`` and the output ``softmax · c_kv`` stays in the
latent space; the caller projects it back with the value half ``W_UV`` and ``o_proj``. Causal within the ragged
step exactly like ``ref_attention`` (``kernels/metadata.py``). An fp8 (e4m3) cache stores ``x / scale``
saturated to +-448 with one per-tensor scale (None = 1.0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .metadata import PAD_SLOT, AttentionMetadata
from .ref_attention import FP8_DTYPE, FP8_MAX, HIGHEST, token_layout


def latent_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, int, int]:
    return (num_blocks, block_size, kv_lora_rank + rope_dim)


def quantize_latent(x, cache_dtype, scale=None):
    """The step's latent rows ``[T, R + P]`` in the cache dtype (fp8: divided by the scale, saturated)."""
    if jnp.dtype(cache_dtype) != FP8_DTYPE:
        return x.astype(cache_dtype)
    s = jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32)
    return jnp.clip(x.astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(cache_dtype)


def write_latent(latent_cache, latent, slot_mapping, *, scale=None):
    """Scatter the step's latent rows ``[T, R + P]`` into their slots (run on a donated cache: in place). The
    cache is seen as ``[num_blocks * block_size, R + P]`` rows, so a slot is the row index as it is (no block /
    offset split in every layer); a slot out of range is dropped, not wrapped, and padding tokens (``PAD_SLOT``)
    write nothing. Each padding token is given its own slot past the end, so every index of the scatter is
    distinct and XLA stores the rows plainly: with repeated indices a 16-bit or fp8 scatter is a
    compare-and-swap loop per element on the GPU, and a bucket's padding rows all on the null block's first slot
    serialize on its words (a 512-token prompt in a 2048-token bucket: 1,536 rows on one slot, in every layer)."""
    nb, bs, width = latent_cache.shape
    T = slot_mapping.shape[0]
    slots = jnp.where(slot_mapping == PAD_SLOT, nb * bs + jnp.arange(T, dtype=slot_mapping.dtype), slot_mapping)
    rows = latent_cache.reshape(nb * bs, width).at[slots].set(
        quantize_latent(latent, latent_cache.dtype, scale), wrap_negative_indices=False, mode="drop",
        unique_indices=True)
    return rows.reshape(latent_cache.shape)


def mla_paged_attention(q_nope_latent, q_rope, latent_cache, md: AttentionMetadata, *, sm_scale: float,
                        kv_lora_rank: int, scale=None, pages_per_step: int = 8):
    """``q_nope_latent [T, H, R]``, ``q_rope [T, H, P]`` → the latent output ``[T, H, R]`` (q's dtype).

    Computed in float32 with an online softmax over chunks of ``pages_per_step`` pages (memory ``O(T *
    chunk)``), looping only over the chunks the step's longest context reaches. Padding tokens return zeros.
    """
    T, H, R = q_nope_latent.shape
    assert R == kv_lora_rank, (R, kv_lora_rank)
    _, bs, width = latent_cache.shape
    num_reqs, pages = md.block_tables.shape
    c = max(1, min(pages_per_step, pages))
    n_chunks = -(-pages // c)
    tables = jnp.pad(md.block_tables, ((0, 0), (0, n_chunks * c - pages)))
    tables = tables.reshape(num_reqs, n_chunks, c).transpose(1, 0, 2)          # [n_chunks, R, c]

    req, qpos, valid = token_layout(md, T)
    klen = jnp.where(valid, md.seq_lens[req], 0)
    q = jnp.concatenate([q_nope_latent, q_rope], axis=-1).astype(jnp.float32) * sm_scale      # [T, H, R + P]
    s_cache = jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32)
    offs = jnp.arange(c * bs, dtype=jnp.int32)

    def chunk(i, carry):
        m, l, acc = carry
        rows = latent_cache[tables[i][req]].reshape(T, c * bs, width).astype(jnp.float32) * s_cache
        s = jnp.einsum("thd,tkd->thk", q, rows, precision=HIGHEST)
        kpos = i * c * bs + offs
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < klen[:, None])
        s = jnp.where(mask[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("thk,tkr->thr", p, rows[..., :R], precision=HIGHEST)
        return m_new, l, acc

    init = (jnp.full((T, H), -jnp.inf, jnp.float32), jnp.zeros((T, H), jnp.float32),
            jnp.zeros((T, H, R), jnp.float32))
    n_live = jnp.minimum((jnp.max(klen) + c * bs - 1) // (c * bs), n_chunks)
    m, l, acc = jax.lax.fori_loop(0, n_live, chunk, init)
    return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q_nope_latent.dtype)
