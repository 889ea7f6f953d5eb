"""The reference MLA attention (kernels/mla_ref.py, absorbed over the paged latent cache) against a naive
decompressed attention: K and V expanded per head from the latents (``c_kv · W_UK`` with the shared rotary key,
``c_kv · W_UV``), causal softmax attention per request, on random ragged steps (decodes, prefill chunks over a
cached prefix, odd lengths, many pages, padding); the latent write; the fp8 latent cache; the ops dispatch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import mla_ref, ops
from jaxserve.kernels.ref_attention import token_layout
from support.synthetic import make_batch


def latent_batch(rng, q_lens, ctx_lens, *, heads, rank, rope, block_size, pad_tokens=0, pad_reqs=0):
    """A random step over a random latent cache ``[num_blocks, block_size, rank + rope]``: (q_nope, q_rope, cache,
    md, W_UK, W_UV) with 16-wide no-rope query heads and 12-wide value heads."""
    q, k, _, md = make_batch(rng, q_lens, ctx_lens, block_size=block_size, num_q_heads=heads, num_kv_heads=1,
                             head_dim=rank + rope, dtype=jnp.float32, pad_tokens=pad_tokens, pad_reqs=pad_reqs)
    cache = k[:, 0]                                         # [num_blocks, block_size, rank + rope]
    w_uk = jnp.asarray(rng.standard_normal((rank, heads, 16), np.float32) / np.sqrt(rank))
    w_uv = jnp.asarray(rng.standard_normal((rank, heads, 12), np.float32) / np.sqrt(rank))
    q_nope = jnp.asarray(rng.standard_normal((q.shape[0], heads, 16), np.float32))
    return q_nope, q[..., rank:], cache, md, w_uk, w_uv


def naive_decompressed(q_nope, q_rope, cache, md, w_uk, w_uv, sm_scale):
    """Per token: its request's context rows gathered, K/V decompressed per head, causal softmax (numpy)."""
    q_nope, q_rope, cache, w_uk, w_uv = (np.asarray(x, np.float64) for x in (q_nope, q_rope, cache, w_uk, w_uv))
    rank, bs = w_uk.shape[0], cache.shape[1]
    req, qpos, valid = (np.asarray(x) for x in token_layout(md, q_nope.shape[0]))
    tables = np.asarray(md.block_tables)
    out = np.zeros((q_nope.shape[0], q_nope.shape[1], w_uv.shape[2]))
    for t in range(q_nope.shape[0]):
        if not valid[t]:
            continue
        pos = np.arange(qpos[t] + 1)
        rows = cache[tables[req[t], pos // bs], pos % bs]                      # [ctx, rank + rope]
        k = np.concatenate([np.einsum("cr,rhd->hcd", rows[:, :rank], w_uk),
                            np.broadcast_to(rows[None, :, rank:], (w_uk.shape[1], len(pos), rows.shape[1] - rank))],
                           axis=-1)
        v = np.einsum("cr,rhd->hcd", rows[:, :rank], w_uv)
        q = np.concatenate([q_nope[t], q_rope[t]], axis=-1)                     # [H, dn + rope]
        s = np.einsum("hd,hcd->hc", q, k) * sm_scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[t] = np.einsum("hc,hcd->hd", p / p.sum(-1, keepdims=True), v)
    return out


def absorbed(q_nope, q_rope, cache, md, w_uk, w_uv, sm_scale, **kwargs):
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    out = mla_ref.mla_paged_attention(q_latent, q_rope, cache, md, sm_scale=sm_scale, kv_lora_rank=w_uk.shape[0],
                                      **kwargs)
    return np.asarray(jnp.einsum("thr,rhv->thv", out, w_uv))


@pytest.mark.parametrize("q_lens,ctx_lens,heads,rank,rope,block_size,pages_per_step", [
    ([1, 1, 1], [1, 17, 40], 4, 32, 8, 4, 8),                  # decodes, odd lengths
    ([5, 1, 9], [5, 33, 70], 8, 64, 16, 16, 2),                # a fresh prompt, a decode, a chunk over a prefix
    ([3, 7], [29, 7], 2, 128, 32, 8, 3),                       # many pages, chunks that end mid-page
])
def test_mla_reference_matches_decompressed_attention(q_lens, ctx_lens, heads, rank, rope, block_size,
                                                      pages_per_step):
    rng = np.random.default_rng(sum(ctx_lens))
    batch = latent_batch(rng, q_lens, ctx_lens, heads=heads, rank=rank, rope=rope, block_size=block_size,
                         pad_tokens=3, pad_reqs=1)
    scale = (16 + rope) ** -0.5
    got = absorbed(*batch, scale, pages_per_step=pages_per_step)
    want = naive_decompressed(*batch, scale)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert not got[sum(q_lens):].any()                          # padding tokens give zeros


def test_write_latent_then_attend_sees_the_step():
    """``write_latent_and_attend`` stores the step's rows at their slots first (padding writes nothing: the
    null block stays as it was), so a fresh prompt attends to itself."""
    rng = np.random.default_rng(0)
    q_nope, q_rope, cache, md, w_uk, w_uv = latent_batch(rng, [6, 1], [6, 9], heads=2, rank=32, rope=8,
                                                         block_size=4, pad_tokens=2)
    latent = jnp.asarray(rng.standard_normal((q_nope.shape[0], 40), np.float32))
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    out, new_cache = ops.write_latent_and_attend(q_latent, q_rope, latent, cache, md, sm_scale=0.2, kv_lora_rank=32)
    slots = np.asarray(md.slot_mapping)[:7]
    flat = np.asarray(new_cache).reshape(-1, 40)
    np.testing.assert_array_equal(flat[slots], np.asarray(latent)[:7])
    np.testing.assert_array_equal(np.asarray(new_cache)[0], np.asarray(cache)[0])
    np.testing.assert_allclose(np.asarray(out), np.asarray(mla_ref.mla_paged_attention(
        q_latent, q_rope, new_cache, md, sm_scale=0.2, kv_lora_rank=32)), rtol=0, atol=0)


def test_write_latent_scatter_has_distinct_indices():
    """The latent write is one scatter XLA may treat as unique-indexed (padding tokens each dropped past the
    end, not all on the null slot): on the GPU a 16-bit scatter with repeated indices is a compare-and-swap
    loop per element, and a bucket's padding rows all on one slot serialize on its words in every layer."""
    cache = jnp.zeros((4, 4, 8), jnp.bfloat16)
    slots = jnp.asarray([5, 6, 0, 0, 0], jnp.int32)
    latent = jnp.arange(40, dtype=jnp.float32).reshape(5, 8)
    hlo = jax.jit(mla_ref.write_latent).lower(cache, latent, slots).as_text()
    assert "unique_indices = true" in hlo or "unique_indices=true" in hlo
    out = np.asarray(mla_ref.write_latent(cache, latent, slots), np.float32).reshape(16, 8)
    np.testing.assert_array_equal(out[[5, 6]], np.asarray(latent)[:2])
    assert not out[[0, 1, 2, 3, 4, 7]].any()                   # padding wrote nothing, the null block included


def test_fp8_latent_cache():
    """An e4m3 latent cache stores ``x / scale`` saturated; attention dequantizes with the same scale and
    stays close to the float cache's result."""
    rng = np.random.default_rng(1)
    q_nope, q_rope, cache, md, w_uk, w_uv = latent_batch(rng, [1, 4], [23, 12], heads=4, rank=32, rope=8,
                                                         block_size=8)
    scale = 0.05
    fp8 = mla_ref.quantize_latent(cache, jnp.float8_e4m3fn, scale)
    assert fp8.dtype == jnp.float8_e4m3fn
    written = mla_ref.write_latent(jnp.zeros_like(fp8), cache[1, :2] * 1000, jnp.asarray([8, 9]), scale=scale)
    assert float(jnp.abs(written.astype(jnp.float32)).max()) == 448.0          # saturated, not inf
    want = absorbed(q_nope, q_rope, cache, md, w_uk, w_uv, 0.3)
    got = absorbed(q_nope, q_rope, fp8, md, w_uk, w_uv, 0.3, scale=scale)
    np.testing.assert_allclose(got, want, atol=0.1, rtol=0.1)


def test_mla_dispatch():
    """The reference backend is mla_ref; the Pallas backends need a GPU (or interpret); an unknown backend
    is refused."""
    rng = np.random.default_rng(2)
    q_nope, q_rope, cache, md, w_uk, _ = latent_batch(rng, [1], [5], heads=2, rank=32, rope=8, block_size=4)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    out = ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=32)
    assert out.shape == q_latent.shape
    with pytest.raises(ValueError, match="unknown attention backend"):
        ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=32, backend="flash")
    with pytest.raises(ValueError, match="prefill must be"):
        ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=32, prefill="dense")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=32, backend="pallas")


@pytest.mark.parametrize("decode_only,prefill", [(True, "kernel"), (False, "kernel"), (False, "reference")])
def test_the_pallas_backends_run_the_kernel(decode_only, prefill):
    """Under the Pallas backends a decode-only step runs mla_decode_pallas (interpreted here) a token a program,
    a step with a prefill chunk its prefill tiles (or, ``prefill="reference"``, the reference); each agrees
    with the reference backend, an fp8 cache's scale included."""
    import dataclasses
    rng = np.random.default_rng(3)
    q_lens = [1, 1, 1] if decode_only else [1, 3]
    ctx = [9, 17, 30] if decode_only else [9, 17]
    q_nope, q_rope, cache, md, w_uk, _ = latent_batch(rng, q_lens, ctx, heads=4, rank=32, rope=16, block_size=8)
    md = dataclasses.replace(md, decode_only=decode_only)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    scale = jnp.float32(0.5)
    fp8 = mla_ref.quantize_latent(cache, jnp.float8_e4m3fn, scale)
    for c, s in ((cache, None), (fp8, scale)):
        want = ops.mla_attention(q_latent, q_rope, c, md, sm_scale=0.2, kv_lora_rank=32, scale=s)
        got = ops.mla_attention(q_latent, q_rope, c, md, sm_scale=0.2, kv_lora_rank=32, scale=s, backend="pallas",
                                interpret=True, prefill=prefill)
        n = int(md.query_start_loc[int(md.num_seqs)])
        np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("decode", ["mgpu", "auto"])
def test_decode_steps_take_the_mosaic_gpu_kernel_where_it_applies(decode, monkeypatch):
    """``decode="mgpu"`` (or ``auto`` at MGPU_MIN_HEADS heads) runs mla_decode_mgpu on a bf16 decode-only step
    (Mosaic GPU's interpret mode here) and agrees with the reference; an fp8 cache falls back to Triton; an
    unknown choice is refused."""
    import dataclasses
    from jaxserve.kernels import mla_decode_mgpu, mla_decode_pallas
    rng = np.random.default_rng(4)
    q_nope, q_rope, cache, md, w_uk, _ = latent_batch(rng, [1, 1, 1], [9, 17, 30], heads=8, rank=64, rope=64,
                                                      block_size=8)
    md = dataclasses.replace(md, decode_only=True)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk).astype(jnp.bfloat16)
    q_rope, cache = q_rope.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    if decode == "auto":
        monkeypatch.setattr(ops, "MGPU_MIN_HEADS", 8)
    calls = []
    for mod in (mla_decode_mgpu, mla_decode_pallas):
        real = mod.mla_paged_attention
        monkeypatch.setattr(mod, "mla_paged_attention",
                            lambda *a, _real=real, _name=mod.__name__, **k: calls.append(_name) or _real(*a, **k))
    want = ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=64)
    got = ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=64, backend="pallas",
                            interpret=True, decode=decode)
    assert calls == [mla_decode_mgpu.__name__]
    np.testing.assert_allclose(np.asarray(got, np.float32)[:3], np.asarray(want, np.float32)[:3], atol=2e-2, rtol=2e-2)
    fp8 = mla_ref.quantize_latent(cache, jnp.float8_e4m3fn, jnp.float32(0.5))
    ops.mla_attention(q_latent, q_rope, fp8, md, sm_scale=0.2, kv_lora_rank=64, scale=jnp.float32(0.5),
                      backend="pallas", interpret=True, decode=decode)
    assert calls[-1] == mla_decode_pallas.__name__
    with pytest.raises(ValueError, match="decode must be"):
        ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=64, decode="flash")


def test_shapes_the_kernels_do_not_tile_take_the_reference(monkeypatch):
    """A rope dim (or latent rank) that is not a power of two of at least 16 (the tiny checkpoints' 8) runs the
    reference under the Pallas backends instead of failing in the kernel's shape check."""
    import dataclasses
    from jaxserve.kernels import mla_decode_pallas
    rng = np.random.default_rng(5)
    q_nope, q_rope, cache, md, w_uk, _ = latent_batch(rng, [1, 1], [9, 17], heads=4, rank=32, rope=8, block_size=8)
    md = dataclasses.replace(md, decode_only=True)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    monkeypatch.setattr(mla_decode_pallas, "mla_paged_attention", lambda *a, **k: pytest.fail("kernel called"))
    want = ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=32)
    got = ops.mla_attention(q_latent, q_rope, cache, md, sm_scale=0.2, kv_lora_rank=32, backend="pallas",
                            interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
