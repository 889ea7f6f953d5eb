"""The image caches' writes (the encoder slab, Mllama's cross-attention pool, the image rows of a step's
embeddings) are scatters XLA may treat as unique-indexed: padding rows target distinct rows past the end
(``drop_targets``) and write nothing, so on the GPU a 16-bit scatter stores rows plainly instead of a
compare-and-swap loop per element that padding rows on one scratch row serialize on."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner import cross_attention_cache, encoder_cache
from jaxserve.runner.encoder_cache import drop_targets


def _unique(hlo: str) -> bool:
    return "unique_indices = true" in hlo or "unique_indices=true" in hlo


def test_drop_targets_are_distinct_and_past_the_end():
    t = drop_targets(5, 7)
    assert t.dtype == np.int32 and list(t) == [7, 8, 9, 10, 11]


def test_encoder_slab_write_drops_padding_rows():
    slab = jnp.zeros((6, 4), jnp.bfloat16)
    emb = jnp.arange(1, 25, dtype=jnp.float32).reshape(2, 3, 4)        # two images (one padding) x 3 rows

    def store(s, d):
        return encoder_cache._encode_and_store(lambda p, x, c: x, None, None, s, emb, d)
    dst = drop_targets(6, 6)
    dst[[0, 1, 2]] = [4, 0, 2]                                          # the real image's rows
    assert _unique(jax.jit(store).lower(slab, dst).as_text())
    out = np.asarray(store(slab, dst), np.float32)
    np.testing.assert_array_equal(out[[4, 0, 2]], np.asarray(emb[0]))
    assert not out[[1, 3, 5]].any()                                     # padding wrote nothing


def test_cross_attention_pool_write_drops_padding_images():
    kv = jnp.arange(1, 2 * 2 * 3 + 1, dtype=jnp.float32).reshape(2, 2, 3, 1, 1)   # [L, B, N, kvh, d]
    family = types.SimpleNamespace(encode_cross_kv=lambda params, px, ar, m, cfg: (kv, -kv))
    pool = (jnp.zeros((2, 3, 3, 1, 1), jnp.bfloat16),) * 2

    def store(p, d):
        return cross_attention_cache._encode_and_store(family, None, None, p, None, None, None, d)
    dst = drop_targets(2, 3)
    dst[0] = 1                                                          # image 0 in slot 1, image 1 padding
    assert _unique(jax.jit(store).lower(pool, dst).as_text())
    k, v = (np.asarray(x, np.float32) for x in store(pool, dst))
    np.testing.assert_array_equal(k[:, 1], np.asarray(kv[:, 0]))
    np.testing.assert_array_equal(v[:, 1], -np.asarray(kv[:, 0]))
    assert not k[:, [0, 2]].any() and not v[:, [0, 2]].any()
