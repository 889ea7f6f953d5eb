"""Pure-jnp paged attention: the CPU path and the oracle every Pallas kernel is tested against.

Cache layout, per layer: ``k_cache`` and ``v_cache`` each ``[num_blocks, block_size, kv_heads, head_dim]``;
a token's flat slot is ``block * block_size + offset``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .metadata import AttentionMetadata


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter the step's new keys/values ``[T, kv_heads, head_dim]`` into their cache slots.

    Meant to run on a donated cache so XLA updates it in place.
    """
    nb, bs, kvh, d = k_cache.shape
    kf = k_cache.reshape(nb * bs, kvh, d).at[slot_mapping].set(k.astype(k_cache.dtype))
    vf = v_cache.reshape(nb * bs, kvh, d).at[slot_mapping].set(v.astype(v_cache.dtype))
    return kf.reshape(nb, bs, kvh, d), vf.reshape(nb, bs, kvh, d)


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


def ragged_paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           pages_per_step: int = 8):
    """Attention of ``q [T, q_heads, head_dim]`` over each token's request context in the paged cache.

    Causal within the step's new tokens; GQA by grouping q heads over kv heads. Computed in float32 with
    an online softmax over chunks of ``pages_per_step`` pages, so memory stays ``O(T * chunk)``.
    Padding tokens return zeros.
    """
    T, hq, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    R, P = md.block_tables.shape
    g = hq // kvh
    c = max(1, min(pages_per_step, P))
    n_chunks = -(-P // c)
    tables = jnp.pad(md.block_tables, ((0, 0), (0, n_chunks * c - P)))
    tables = tables.reshape(R, n_chunks, c).transpose(1, 0, 2)          # [n_chunks, R, c]

    req, qpos, valid = token_layout(md, T)
    klen = jnp.where(valid, md.seq_lens[req], 0)                          # [T]
    qg = q.reshape(T, kvh, g, d).astype(jnp.float32) * sm_scale
    offs = jnp.arange(c * bs, dtype=jnp.int32)

    def chunk(carry, xs):
        m, l, acc = carry
        i, tab = xs                                                        # tab [R, c]
        blk = tab[req]                                                     # [T, c]
        kb = k_cache[blk].reshape(T, c * bs, kvh, d).astype(jnp.float32)
        vb = v_cache[blk].reshape(T, c * bs, kvh, d).astype(jnp.float32)
        s = jnp.einsum("thgd,tkhd->thgk", qg, kb)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = i * c * bs + offs                                           # [c*bs]
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < klen[:, None])
        if sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,tkhd->thgd", p, vb)
        return (m_new, l, acc), None

    init = (jnp.full((T, kvh, g), -jnp.inf, jnp.float32), jnp.zeros((T, kvh, g), jnp.float32),
            jnp.zeros((T, kvh, g, d), jnp.float32))
    # Loop only over the chunks the longest context in this step reaches (a dynamic trip count), so cost
    # follows the real context, not the block table's padded width.
    n_live = jnp.minimum((jnp.max(klen) + c * bs - 1) // (c * bs), n_chunks)
    m, l, acc = jax.lax.fori_loop(0, n_live, lambda i, carry: chunk(carry, (i, tables[i]))[0], init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(T, hq, d).astype(q.dtype)
