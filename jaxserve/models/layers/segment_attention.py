"""Bidirectional attention among patches of equal segment id, blockwise with an online softmax: no ``[heads, N,
N]`` score matrix, and key blocks that hold none of a query block's segments are not visited.

A row of ``N`` patches (``seg [R, N]``: each patch's image or window, pads -1) is cut into query blocks and key
blocks of ``block`` patches. A segment is taken to be a span of the row (``pack`` lays each image and each window
on consecutive patches, its pads inside it): query block ``i`` needs only the key blocks from the first patch of
its first segment to the last patch of its last one, ``count[i]`` of them starting at ``first[i]``. Step ``t``
of the loop gives every query block at once its key block ``first[i] + t`` (a gather; a block past its count is
masked out), so the scores of a step are ``heads x N x block`` and the loop runs as many steps as the widest
query block needs (``dynamic``: one image of the whole row needs all ``N / block``, several small images to a
row only their own span) or always ``N / block`` (static: no trip count read back from the device; the masked
steps still compute). Softmax statistics in float32, as HF's eager path; probabilities cast to ``v``'s dtype
for the second matmul. A pad query sees nothing and gives 0 (its row is dropped by the caller).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30          # the running max's start: finite, so a query with no key yet has exp(-inf - _NEG) = 0


def _divisor_block(n: int, block: int) -> int:
    """The largest divisor of ``n`` of at most ``block``."""
    return next(d for d in range(min(n, block), 0, -1) if n % d == 0)


def _key_blocks(seg: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Each query block's first key block and how many it needs ``[R, N / block]``: the span from the first
    patch of the block's first segment to the last patch of its last one (none for an all-pad block)."""
    r, n = seg.shape
    rows = jnp.arange(r)[:, None]
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (r, n))
    valid = seg >= 0
    ids = jnp.where(valid, seg, n)                                   # pads to a bin of their own
    start = jnp.full((r, n + 1), n, jnp.int32).at[rows, ids].min(pos)
    end = jnp.zeros((r, n + 1), jnp.int32).at[rows, ids].max(pos + 1)
    lo = jnp.where(valid, jnp.take_along_axis(start, ids, 1), n).reshape(r, n // block, block).min(-1)
    hi = jnp.where(valid, jnp.take_along_axis(end, ids, 1), 0).reshape(r, n // block, block).max(-1)
    first = jnp.minimum(lo // block, n // block - 1)
    return first, jnp.maximum(-(-hi // block) - lo // block, 0)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, block: int,
                      dynamic: bool | None = None) -> jax.Array:
    """``q, k, v [R, N, heads, hd]``, ``seg [R, N]`` → ``[R, N, heads * hd]``: each query over the keys of its
    own segment (pads: none, 0), in blocks of at most ``block`` patches (a divisor of ``N``, or ``block`` with
    the row padded when ``N`` has no divisor of at least half of ``block``). ``dynamic`` None: on the CPU only (on a
    GPU a loop bound computed on the device is read back by the host every step)."""
    r, n, heads, hd = q.shape
    b = _divisor_block(n, block)
    if b < min(n, block) // 2:                       # e.g. 4 x a prime: pad the row rather than tiny blocks
        pad = -n % block
        q, k, v = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (q, k, v))
        out = segment_attention(q, k, v, jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1), block, dynamic)
        return out[:, :n]
    if dynamic is None:
        dynamic = jax.default_backend() == "cpu"
    nb = n // b
    first, count = _key_blocks(seg, b)
    # head-major blocks [R, nb, heads, b, hd], transposed once here, so neither matmul of a step transposes
    qb, kb, vb = (t.reshape(r, nb, b, heads, hd).transpose(0, 1, 3, 2, 4) for t in (q, k, v))
    sq = seg.reshape(r, nb, b)
    scale = hd ** -0.5

    def step(t, carry):
        m, l, acc = carry
        j = jnp.minimum(first + t, nb - 1)                                     # [R, nb]: each block's key block
        kt = jnp.take_along_axis(kb, j[:, :, None, None, None], 1)
        vt = jnp.take_along_axis(vb, j[:, :, None, None, None], 1)
        st = jnp.take_along_axis(sq, j[:, :, None], 1)
        see = (sq[:, :, :, None] == st[:, :, None, :]) & (sq[:, :, :, None] >= 0) & (t < count)[:, :, None, None]
        s = jnp.einsum("rnhqd,rnhkd->rnhqk", qb, kt, preferred_element_type=jnp.float32) * scale
        s = jnp.where(see[:, :, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        pv = jnp.einsum("rnhqk,rnhkd->rnhqd", p.astype(v.dtype), vt, preferred_element_type=jnp.float32)
        return m_new, l, alpha[..., None] * acc + pv

    init = (jnp.full((r, nb, heads, b), _NEG, jnp.float32), jnp.zeros((r, nb, heads, b), jnp.float32),
            jnp.zeros((r, nb, heads, b, hd), jnp.float32))
    steps = count.max() if dynamic else nb
    _, l, acc = jax.lax.fori_loop(0, steps, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(0, 1, 3, 2, 4).reshape(r, n, heads * hd).astype(q.dtype)
