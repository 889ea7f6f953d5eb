"""``segment_attention`` (the vision towers' blockwise attention among patches of one segment) against a float64
softmax over each segment's keys: rows of several images with pads inside and after them, an all-pad row, one
segment over the whole row, block sizes that divide the row, that do not (padded) and that exceed it, the
skipping and the static trip count, float32 and bfloat16; the key blocks it visits are only a segment's span."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.layers.segment_attention import _key_blocks, segment_attention


def reference(q, k, v, seg) -> np.ndarray:
    """Float64: each non-pad query over the keys of its segment; pads 0."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    seg = np.asarray(seg)
    r, n, h, d = q.shape
    s = np.einsum("rqhd,rkhd->rhqk", q, k) / np.sqrt(d)
    see = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    s = np.where(see[:, None], s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("rhqk,rkhd->rqhd", p, v).reshape(r, n, h * d)


def rows(n: int) -> np.ndarray:
    """Four rows of ``n`` patches: three images with pads inside and after them; one image over the whole row;
    a short image then pads; all pads."""
    seg = np.full((4, n), -1, np.int32)
    seg[0, : n // 3] = 0
    seg[0, n // 3 + 5: 2 * n // 3] = 1
    seg[0, n // 6: n // 6 + 7] = -1                          # an image's padding slots, inside its span
    seg[0, 2 * n // 3: n - 9] = 2
    seg[1] = 0
    seg[2, :40] = 0
    return seg


def inputs(n: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((4, n, 2, 16)) * 2, dtype) for _ in range(3)]


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("n, block", [(768, 128), (768, 100), (776, 128), (300, 512)])
def test_equals_the_softmax_over_each_segment(n, block, dynamic):
    q, k, v = inputs(n, jnp.float32)
    seg = rows(n)
    got = np.asarray(jax.jit(segment_attention, static_argnums=(4, 5))(q, k, v, jnp.asarray(seg), block, dynamic))
    want = reference(q, k, v, seg)
    valid = seg >= 0
    np.testing.assert_allclose(got[valid], want[valid], atol=2e-5, rtol=0)
    assert not np.any(got[~valid])                            # a pad query sees nothing: 0, not NaN


def test_bfloat16_within_its_precision():
    q, k, v = inputs(512, jnp.bfloat16, seed=1)
    seg = rows(512)
    got = np.asarray(segment_attention(q, k, v, jnp.asarray(seg), 64), np.float32)
    want = reference(*(np.asarray(t, ml_dtypes.bfloat16).astype(np.float32) for t in (q, k, v)), seg)
    valid = seg >= 0
    np.testing.assert_allclose(got[valid], want[valid], atol=3e-2, rtol=0)


def test_key_blocks_cover_only_each_query_blocks_segments():
    """Four images of 200 patches in a row of 1024 (blocks of 128): each query block visits the key blocks
    from its first image's start to its last image's end (a block straddling two images: both), the pad tail
    none; so the loop runs 4 steps, not 8, and visits 23 of the 64 block pairs."""
    seg = np.full((1, 1024), -1, np.int32)
    for i in range(4):
        seg[0, 200 * i: 200 * (i + 1)] = i
    first, count = (np.asarray(a)[0] for a in _key_blocks(jnp.asarray(seg), 128))
    starts, ends = np.arange(8) * 128, np.arange(1, 9) * 128
    for i in range(8):
        ids = set(seg[0, starts[i]:ends[i]]) - {-1}
        if not ids:
            assert count[i] == 0
            continue
        lo, hi = 200 * min(ids), 200 * (max(ids) + 1)
        assert (first[i], count[i]) == (lo // 128, -(-hi // 128) - lo // 128)
    assert count.max() == 4 and count.sum() == 23
