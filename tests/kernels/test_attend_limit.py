"""``AttentionMetadata.attend_limit`` (bidirectional attention among one image's tokens, Gemma 3): the
reference against a dense mask written out from HF's rule (global layers: causal OR same image; sliding
layers: that AND the window), and the Pallas prefill tiles in interpret mode against the reference, in a
step that mixes decodes, a plain prefill and prefills whose chunks hold image spans."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import synthetic
from jaxserve.kernels import ops, ref_attention
from jaxserve.kernels import paged_attention_pallas as pa

SMALL_TILES = dict(decode_block_k=16, prefill_block_m=16, prefill_block_k=16)
# per request: (new tokens, context, image spans [start, end) in absolute positions, inside the new tokens)
CASES = [(1, 40, []), (30, 50, [(22, 31), (35, 47)]), (1, 7, []), (24, 24, [(0, 16)]), (12, 60, [])]


def batch(seed, dtype=jnp.float32, hq=4, kvh=2, d=64, bs=16):
    rng = np.random.default_rng(seed)
    q_lens, ctx = [c[0] for c in CASES], [c[1] for c in CASES]
    q, k, v, md = synthetic.make_batch(rng, q_lens, ctx, block_size=bs, num_q_heads=hq, num_kv_heads=kvh,
                                       head_dim=d, dtype=dtype, pad_tokens=3, pad_reqs=1)
    limit = np.full(q.shape[0], -1, np.int32)
    t = 0
    for q_len, c, spans in CASES:
        for p in range(c - q_len, c):
            for a, b in spans:
                if a <= p < b:
                    limit[t] = b - 1
            t += 1
    return q, k, v, md, limit


def dense_oracle(q, k, v, md, limit, window, sm_scale):
    """Each token's attention over its request's keys with HF's mask, in float64 numpy."""
    kc, vc = (np.asarray(x, np.float64) for x in (k, v))
    qs, tables = np.asarray(q, np.float64), np.asarray(md.block_tables)
    qsl, lens = np.asarray(md.query_start_loc), np.asarray(md.seq_lens)
    out = np.zeros_like(qs)
    g = q.shape[1] // k.shape[1]
    bs = k.shape[2]
    for r in range(int(md.num_seqs)):
        n = lens[r]
        pos = np.arange(n)
        keys = kc[tables[r, pos // bs], :, pos % bs]                 # [n, kvh, d]
        vals = vc[tables[r, pos // bs], :, pos % bs]
        for t in range(qsl[r], qsl[r + 1]):
            qp = n - (qsl[r + 1] - t)
            visible = pos <= max(qp, limit[t])
            if window is not None:
                visible &= pos > qp - window
            for h in range(q.shape[1]):
                s = keys[:, h // g] @ qs[t, h] * sm_scale
                s = np.where(visible, s, -np.inf)
                p = np.exp(s - s.max())
                out[t, h] = p @ vals[:, h // g] / p.sum()
    return out


@pytest.mark.parametrize("window", [None, 9])
def test_reference_matches_the_dense_mask(window):
    q, k, v, md, limit = batch(1)
    md = dataclasses.replace(md, attend_limit=jnp.asarray(limit))
    out = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=0.125, sliding_window=window)
    n = int(md.query_start_loc[int(md.num_seqs)])
    want = dense_oracle(q, k, v, md, limit, window, 0.125)
    np.testing.assert_allclose(np.asarray(out)[:n], want[:n], atol=2e-5, rtol=1e-4)
    # the limit changes the image tokens' rows (else the test would not test it) and nothing else
    causal = ref_attention.ragged_paged_attention(q, k, v, dataclasses.replace(md, attend_limit=None),
                                                  sm_scale=0.125, sliding_window=window)
    changed = (np.abs(np.asarray(out) - np.asarray(causal)).max(axis=(1, 2)) > 1e-6)[:n]
    assert not changed[limit[:n] < 0].any() and changed[limit[:n] >= 0].sum() > 20


@pytest.mark.parametrize("window,dtype", [(None, jnp.float32), (9, jnp.float32), (None, jnp.bfloat16)])
def test_pallas_prefill_tiles_match_the_reference(window, dtype):
    q, k, v, md, limit = batch(2, dtype)
    md = dataclasses.replace(md, attend_limit=jnp.asarray(limit))
    kw = dict(sm_scale=0.125, sliding_window=window)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, **kw)
    out = pa.ragged_paged_attention(q, k, v, md, interpret=True, poison_output=True, **SMALL_TILES, **kw)
    n = int(md.query_start_loc[int(md.num_seqs)])
    o, r = np.asarray(out, np.float32)[:n], np.asarray(ref, np.float32)[:n]
    assert not np.isnan(o).any()
    err = float(np.abs(o - r).max() / np.abs(r).max())
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2), err
    # through the engine's entry point (write, then attend; "auto" never takes the Mosaic GPU prefill here)
    new_k = jnp.asarray(np.random.default_rng(3).standard_normal((q.shape[0], k.shape[1], q.shape[2])), dtype)
    outs = [ops.write_kv_and_attend(q, new_k, new_k, k, v, md, backend=b, interpret=True, **kw)[0]
            for b in ("reference", "pallas")]
    np.testing.assert_allclose(np.asarray(outs[1], np.float32)[:n], np.asarray(outs[0], np.float32)[:n],
                               atol=1e-4 if dtype == jnp.float32 else 5e-2)


def test_the_limit_is_an_input_only_where_given():
    """A step without a limit has today's pytree (hence program); the decode-only launch refuses one."""
    q, k, v, md, limit = batch(4)
    with_limit = dataclasses.replace(md, attend_limit=jnp.asarray(limit))
    assert len(jax.tree.leaves(with_limit)) == len(jax.tree.leaves(md)) + 1
    with pytest.raises(ValueError, match="decode_only"):
        pa.ragged_paged_attention(q, k, v, dataclasses.replace(with_limit, decode_only=True), sm_scale=0.125,
                                  interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda pytest -m gpu)")
def test_gpu_steps_with_a_limit_take_the_triton_prefill():
    """On the GPU, a large bf16 step (the "pallas" backend's auto prefill would take the Mosaic GPU kernel,
    which has no attend limit) with an image span: the Triton prefill tiles' rows, as the reference's."""
    rng = np.random.default_rng(7)
    q, k, v, md = synthetic.make_batch(rng, [1, 600, 1], [90, 700, 30], block_size=16, num_q_heads=8,
                                       num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16, pad_tokens=5,
                                       pad_reqs=1)
    limit = np.full(q.shape[0], -1, np.int32)
    limit[1 + 200:1 + 456] = 100 + 455          # a 256-token image at positions 300..555 of request 1
    md = dataclasses.replace(md, attend_limit=jnp.asarray(limit))
    new = jnp.asarray(rng.standard_normal((q.shape[0], 2, 128)), jnp.bfloat16)
    ref, _, _ = ops.write_kv_and_attend(q, new, new, k, v, md, sm_scale=128 ** -0.5, backend="reference")
    out, _, _ = ops.write_kv_and_attend(q, new, new, k, v, md, sm_scale=128 ** -0.5, backend="pallas")
    n = int(md.query_start_loc[int(md.num_seqs)])
    r, o = np.asarray(ref, np.float32)[:n], np.asarray(out, np.float32)[:n]
    assert float(np.abs(o - r).max() / np.abs(r).max()) <= 2e-2
