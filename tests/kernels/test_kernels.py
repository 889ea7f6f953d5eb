"""Pallas paged attention (interpret mode on CPU) against the pure-jnp reference, on fresh random batches.

Each case is a ragged step: decodes (q_len 1) and prefill chunks (q_len > 1) together, partial last blocks,
shuffled physical blocks with a shared prefix block, padding tokens and padding requests. Outputs start
NaN-poisoned (``poison_output``), so a row no kernel writes fails. Error: max |out - ref| / max |ref|.
"""
import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from support import synthetic
from jaxserve.kernels import ops, ref_attention
from jaxserve.kernels import paged_attention_pallas as pa

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
# Small tiles: several q-blocks and KV iterations per request even at tiny sizes.
SMALL_TILES = dict(decode_block_k=16, prefill_block_m=16, prefill_block_k=16)


def max_rel_err(out, ref, md=None):
    """Over every row, or with ``md`` the real tokens' rows only (without ``poison_output`` the kernel
    leaves padding tokens' rows unwritten)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if md is not None:
        n_real = int(md.query_start_loc[int(md.num_seqs)])
        out, ref = out[:n_real], ref[:n_real]
    assert not np.isnan(out).any(), "NaN in output: a row was never written"
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def check(seed, q_lens, ctx_lens, *, hq, kvh, d, bs, dtype, soft_cap=None, window=None, splits=None,
          tiles=SMALL_TILES, pad_tokens=3, pad_reqs=1):
    rng = np.random.default_rng(seed)
    q, k, v, md = synthetic.make_batch(rng, q_lens, ctx_lens, block_size=bs, num_q_heads=hq, num_kv_heads=kvh,
                                       head_dim=d, dtype=dtype, pad_tokens=pad_tokens, pad_reqs=pad_reqs)
    kw = dict(sm_scale=d ** -0.5, soft_cap=soft_cap, sliding_window=window)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, **kw)
    out = pa.ragged_paged_attention(q, k, v, md, interpret=True, poison_output=True, decode_splits=splits,
                                    **tiles, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    n_real = int(md.query_start_loc[int(md.num_seqs)])
    assert not np.asarray(out[n_real:], np.float32).any(), "padding tokens must be zeros"
    err = max_rel_err(out, ref)
    assert err <= TOL[dtype], f"max rel err {err:.2e} > {TOL[dtype]:.0e}"
    # the engine's path: no buffer passed in, the first launch allocates the output (padding rows unwritten)
    plain = pa.ragged_paged_attention(q, k, v, md, interpret=True, decode_splits=splits, **tiles, **kw)
    np.testing.assert_array_equal(np.asarray(plain[:n_real], np.float32), np.asarray(out[:n_real], np.float32))


# (q heads, kv heads, head_dim) of the shipped configs: SmolLM2, Llama-3-8B, Qwen2.5-7B.
@pytest.mark.parametrize("hq,kvh,d,bs", [(9, 3, 64, 16), (32, 8, 128, 32), (28, 4, 128, 64)])
def test_mixed_step_f32(hq, kvh, d, bs):
    check(hq * 100 + bs, [1, 9, 1, 20, 1], [37, 9, 1, 53, bs + 1], hq=hq, kvh=kvh, d=d, bs=bs,
          dtype=jnp.float32, splits=1)


@pytest.mark.parametrize("hq,kvh,d,bs", [(9, 3, 64, 32), (32, 8, 128, 16), (28, 4, 128, 64)])
def test_mixed_step_bf16_default_tiles(hq, kvh, d, bs):
    check(7 + bs, [5, 1, 1, 70, 1], [40, 100, 2, 140, 17], hq=hq, kvh=kvh, d=d, bs=bs, dtype=jnp.bfloat16,
          tiles={})


@pytest.mark.parametrize("splits", [2, 4])
def test_flash_decoding_splits(splits):
    """Decode-only batch with the KV axis split; uneven lengths leave some splits empty."""
    check(splits, [1, 1, 1, 1], [150, 3, 64, 97], hq=8, kvh=2, d=64, bs=16, dtype=jnp.float32, splits=splits)


@pytest.mark.parametrize("splits,window", [(1, None), (4, None), (2, 40)])
def test_decode_only_launch(splits, window):
    """decode_only: the decode launch alone (no prefill tile slots); padding requests and tokens, empty
    splits, and a window give the reference's rows."""
    check(30 + splits, [1, 1, 1, 1, 1], [150, 3, 64, 97, 1], hq=8, kvh=2, d=64, bs=16, dtype=jnp.float32,
          splits=splits, window=window, tiles=dict(SMALL_TILES, decode_only=True))


def test_decode_only_from_metadata():
    """The engine marks uniform decode steps in the metadata (a static field): same rows, and a prefill
    request in an unmarked step still gets its rows."""
    import dataclasses
    rng = np.random.default_rng(5)
    q, k, v, md = synthetic.make_batch(rng, [1, 1, 1], [40, 9, 70], block_size=16, num_q_heads=4,
                                       num_kv_heads=2, head_dim=64, dtype=jnp.float32, pad_tokens=2, pad_reqs=1)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=0.125)
    marked = dataclasses.replace(md, decode_only=True)
    out = pa.ragged_paged_attention(q, k, v, marked, sm_scale=0.125, interpret=True, poison_output=True,
                                    **SMALL_TILES)
    assert max_rel_err(out, ref, md) <= 1e-4
    # the flag changes the compiled program (a static pytree field), not the arrays
    assert jax.tree_util.tree_structure(marked) != jax.tree_util.tree_structure(md)
    assert ops.paged_attention(q, k, v, marked, sm_scale=0.125).shape == q.shape   # the reference ignores it


def test_soft_cap_and_sliding_window():
    check(11, [1, 12, 1, 30], [90, 40, 5, 30], hq=9, kvh=3, d=64, bs=16, dtype=jnp.float32, soft_cap=5.0,
          window=20, splits=2)


def test_prefill_only_no_cache():
    check(12, [33, 17], [33, 17], hq=4, kvh=4, d=64, bs=16, dtype=jnp.float32, pad_tokens=0, pad_reqs=0)


def test_fp8_cache_matches_reference_and_write_kv_roundtrip():
    rng = np.random.default_rng(5)
    hq, kvh, d, bs = 8, 2, 64, 16
    q, k, v, md = synthetic.make_batch(rng, [1, 6, 1], [40, 20, 9], block_size=bs, num_q_heads=hq,
                                       num_kv_heads=kvh, head_dim=d, dtype=jnp.bfloat16, pad_tokens=2)
    k_scale, v_scale = jnp.array([0.02, 0.05]), jnp.float32(0.03)   # per head and per tensor
    fp8 = ops.kv_cache_dtype("fp8", jnp.bfloat16)
    # Write every cache slot through write_kv, so the fp8 cache holds quantised real values.
    nslots = k.shape[0] * bs
    slots = jnp.arange(nslots, dtype=jnp.int32)
    by_slot = lambda x: jnp.swapaxes(x, 1, 2).reshape(nslots, kvh, d)      # noqa: E731  [slot, head, d]
    k_shape, v_shape = ops.kv_cache_shapes(k.shape[0], bs, kvh, d, fp8)
    assert v_shape == (k.shape[0], kvh, d, bs)                              # fp8 V pages are stored transposed
    k8, v8 = ops.write_kv(jnp.zeros(k_shape, fp8), jnp.zeros(v_shape, fp8), by_slot(k), by_slot(v), slots,
                          k_scale=k_scale, v_scale=v_scale)
    assert k8.dtype == fp8 and v8.shape == v_shape
    np.testing.assert_array_equal(np.asarray(v8.astype(jnp.float32)), np.asarray(synthetic.quantize_caches(
        k, v, fp8, k_scale, v_scale)[1].astype(jnp.float32)))               # the write and the whole-cache cast agree
    deq = ref_attention.dequantize_kv(jnp.swapaxes(k8, 1, 2), k_scale)                # [.., head, d] per head
    kf = jnp.swapaxes(k, 1, 2).astype(jnp.float32)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 (values stay far below 448 * scale).
    assert float(jnp.max(jnp.abs(deq - kf) / (jnp.abs(kf) + 1e-3))) < 0.07
    kw = dict(sm_scale=d ** -0.5, k_scale=k_scale, v_scale=v_scale)
    ref8 = ref_attention.ragged_paged_attention(q, k8, v8, md, **kw)
    out8 = ops.paged_attention(q, k8, v8, md, backend="pallas", interpret=True, **kw)
    assert max_rel_err(out8, ref8, md) <= 1e-2
    # f16 matmul operands (the e4m3 -> f16 conversion is one instruction on Hopper); output stays bf16.
    out8h = ops.paged_attention(q, k8, v8, md, backend="pallas", interpret=True, dot_dtype=jnp.float16, **kw)
    assert out8h.dtype == q.dtype
    assert max_rel_err(out8h, ref8, md) <= 1e-2
    # And the fp8 result stays close to the unquantised attention.
    ref16 = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=d ** -0.5)
    assert max_rel_err(out8, ref16, md) < 0.1


def test_ops_dispatch():
    assert ops.default_backend() == "reference"          # tests run on CPU
    rng = np.random.default_rng(3)
    q, k, v, md = synthetic.make_batch(rng, [1, 3], [10, 3], block_size=16, num_q_heads=4, num_kv_heads=2,
                                       head_dim=64, dtype=jnp.float32)
    ref = ops.paged_attention(q, k, v, md, sm_scale=0.125)
    out = ops.paged_attention(q, k, v, md, sm_scale=0.125, backend="pallas", interpret=True)
    assert max_rel_err(out, ref) <= 1e-4
    with pytest.raises(ValueError, match="unknown attention backend"):
        ops.paged_attention(q, k, v, md, sm_scale=0.125, backend="triton")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        ops.paged_attention(q, k, v, md, sm_scale=0.125, backend="pallas")     # compiled Pallas on CPU
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        ops.kv_cache_dtype("int4", jnp.bfloat16)
    assert ops.kv_cache_dtype("auto", jnp.bfloat16) == ops.kv_cache_dtype(None, jnp.bfloat16) == jnp.bfloat16
    assert ops.kv_cache_dtype("fp8_e4m3", jnp.bfloat16) == ops.kv_cache_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn


def test_init_kv_caches():
    """One zeroed (K, V) pair per layer; an fp8 cache's V pages transposed."""
    caches = ops.init_kv_caches(2, 5, 16, 3, 64, jnp.float8_e4m3fn)
    assert len(caches) == 2
    assert [(c.shape, c.dtype) for c in caches[1]] == [((5, 3, 16, 64), jnp.float8_e4m3fn), ((5, 3, 64, 16), jnp.float8_e4m3fn)]
    assert not any(c.astype(jnp.float32).any() for pair in caches for c in pair)
    k, v = ops.init_kv_caches(1, 5, 16, 3, 64, jnp.bfloat16)[0]
    assert k.shape == v.shape == (5, 3, 16, 64) and v.dtype == jnp.bfloat16


def test_write_kv_then_attend_sees_new_tokens():
    """The engine's order: write the step's K/V, then attend; the new keys must take part."""
    rng = np.random.default_rng(9)
    q, k, v, md = synthetic.make_batch(rng, [4, 1], [4, 30], block_size=16, num_q_heads=4, num_kv_heads=2,
                                       head_dim=64, dtype=jnp.float32)
    new_k = jnp.asarray(rng.standard_normal((q.shape[0], 2, 64), np.float32))
    new_v = jnp.asarray(rng.standard_normal((q.shape[0], 2, 64), np.float32))
    k2, v2 = ops.write_kv(k, v, new_k, new_v, md.slot_mapping)
    before = pa.ragged_paged_attention(q, k, v, md, sm_scale=0.125, interpret=True)
    after = pa.ragged_paged_attention(q, k2, v2, md, sm_scale=0.125, interpret=True)
    ref = ref_attention.ragged_paged_attention(q, k2, v2, md, sm_scale=0.125)
    assert max_rel_err(after, ref) <= 1e-4
    assert max_rel_err(before, ref) > 1e-2


@pytest.mark.parametrize("case", ["f32", "bf16-decode-only", "fp8", "kvh3-split", "mgpu"])
def test_write_kv_and_attend_packed_matches_reference(case):
    """The layer's K/V write + attention as the Pallas backend runs it (q, k, v packed in one array that both
    kernels read) against the reference's scatter then attention: same output, same cache (block 0, where
    the reference's padding tokens land, aside). Ragged prefill chunks and decodes; a decode-only step; an
    fp8 cache (q cast to f16 in the kernel); 3 kv heads (padded head rows in the write) in a decode-only step
    split 4 ways (the combine's rows); ``pallas-mgpu`` (such steps write and attend unpacked)."""
    rng = np.random.default_rng(21)
    decode_only = case in ("bf16-decode-only", "kvh3-split")
    q_lens, ctx_lens = ([1, 1, 1], [40, 9, 77]) if decode_only else ([1, 5, 1, 20], [40, 9, 17, 20])
    dtype = jnp.float32 if case == "f32" else jnp.bfloat16
    kvh = 3 if case == "kvh3-split" else 2
    q, k_cache, v_cache, md = synthetic.make_batch(rng, q_lens, ctx_lens, block_size=16, num_q_heads=3 * kvh,
                                                   num_kv_heads=kvh, head_dim=64, dtype=dtype, pad_tokens=3,
                                                   pad_reqs=1)
    kw = dict(sm_scale=0.125)
    if case == "fp8":
        scale = jnp.asarray([0.5, 1.5], jnp.float32)
        k_cache, v_cache = synthetic.quantize_caches(k_cache, v_cache, jnp.float8_e4m3fn, scale, scale)
        kw |= dict(k_scale=scale, v_scale=scale)
    md = dataclasses.replace(md, decode_only=decode_only)
    new_k, new_v = (jnp.asarray(rng.standard_normal((q.shape[0], kvh, 64)), dtype) for _ in range(2))
    backend = "pallas-mgpu" if case == "mgpu" else "pallas"
    extra = dict(decode_splits=4, decode_block_k=16) if case == "kvh3-split" else {}
    want, wk, wv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, **kw)
    got, gk, gv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, backend=backend,
                                          interpret=True, **kw, **extra)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert max_rel_err(got, want, md) <= TOL[dtype]
    for g, w in ((gk, wk), (gv, wv)):
        np.testing.assert_array_equal(np.asarray(g[1:].astype(jnp.float32)), np.asarray(w[1:].astype(jnp.float32)))


@pytest.mark.parametrize("dtype,prefill_kernel", [(jnp.float32, "triton"), (jnp.bfloat16, "mgpu")])
def test_packed_queries_are_read_by_stride(dtype, prefill_kernel):
    """``num_q_heads``: the kernel reads the first heads of each token's row as its queries and skips the
    rest, whatever they hold (NaN here), and returns only the query heads; the Mosaic GPU prefill gets the
    queries' slice."""
    rng = np.random.default_rng(22)
    q, k, v, md = synthetic.make_batch(rng, [1, 7, 1], [30, 7, 50], block_size=16, num_q_heads=4, num_kv_heads=2,
                                       head_dim=64, dtype=dtype, pad_tokens=2, pad_reqs=1)
    packed = jnp.concatenate([q, jnp.full((q.shape[0], 3, 64), jnp.nan, q.dtype)], axis=1)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=0.125)
    for splits in (1, 4):
        out = pa.ragged_paged_attention(packed, k, v, md, sm_scale=0.125, interpret=True, poison_output=True,
                                        num_q_heads=4, decode_splits=splits, prefill_kernel=prefill_kernel,
                                        **SMALL_TILES)
        assert out.shape == q.shape and max_rel_err(out, ref, md) <= TOL[dtype]
    with pytest.raises(ValueError, match="num_q_heads"):
        pa.ragged_paged_attention(q, k, v, md, sm_scale=0.125, interpret=True, num_q_heads=5)


@pytest.mark.parametrize("decode_only,prefill_kernel,cache", [(True, "triton", None), (False, "mgpu", None),
                                                             (True, "triton", "fp8"), (False, "triton", "fp8")])
def test_packed_write_and_attention_lower_for_cuda(decode_only, prefill_kernel, cache):
    """The packed path's GPU builds (the K/V write, the decode-only launch; the Mosaic GPU prefill fed the
    queries' slice; an fp8 cache's transposed V pages in the write, the decode-only and the fused launch)
    lower for CUDA here on CPU."""
    from jaxserve.kernels import kv_write_pallas
    rng = np.random.default_rng(23)
    q_lens, ctx_lens = ([1] * 4, [40, 9, 17, 300]) if decode_only else ([1, 200], [40, 300])
    q, k, v, md = synthetic.make_batch(rng, q_lens, ctx_lens, block_size=16, num_q_heads=8, num_kv_heads=2,
                                       head_dim=128, dtype=jnp.bfloat16, pad_tokens=4, pad_reqs=1)
    md = dataclasses.replace(md, decode_only=decode_only)
    qkv = jnp.concatenate([q, q[:, :4]], axis=1)
    if cache:
        k, v = synthetic.quantize_caches(k, v, jnp.float8_e4m3fn)

    def step(qkv, k, v, md):
        k, v = kv_write_pallas.write_kv_packed(k, v, qkv, md.slot_mapping, num_q_heads=8)
        return pa.ragged_paged_attention(qkv, k, v, md, sm_scale=0.1, num_q_heads=8, prefill_kernel=prefill_kernel)

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(step).trace(qkv, k, v, md).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and (prefill_kernel != "mgpu" or "mosaic_gpu" in text)


def test_fp8_cache_transposed_v_pages_in_every_launch():
    """An fp8 cache's V pages are stored transposed ([blocks, kv heads, D, block], gathered as [D, pages, block]
    tiles): the reference's rows in the decode-only and the mixed launch, split and not; its GPU build lowers
    for CUDA; key tiles that do not span whole pages are refused."""
    rng = np.random.default_rng(24)
    q, k, v, md = synthetic.make_batch(rng, [1, 1, 1, 1], [40, 9, 77, 33], block_size=16, num_q_heads=8,
                                       num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16, pad_tokens=3, pad_reqs=1)
    qm, km, vm, mdm = synthetic.make_batch(rng, [1, 20, 1, 7], [40, 20, 77, 33], block_size=16, num_q_heads=8,
                                           num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16, pad_tokens=3, pad_reqs=1)
    scale = jnp.asarray([0.5, 1.5], jnp.float32)
    kw = dict(sm_scale=0.125, decode_block_k=32, prefill_block_m=16, prefill_block_k=16, k_scale=scale,
              v_scale=scale)
    for q, k, v, md in ((q, k, v, dataclasses.replace(md, decode_only=True)), (qm, km, vm, mdm)):
        k, vt = synthetic.quantize_caches(k, v, jnp.float8_e4m3fn, scale, scale)   # V pages transposed
        ref = ref_attention.ragged_paged_attention(q, k, vt, md, sm_scale=0.125, k_scale=scale, v_scale=scale)
        for splits in (1, 4):
            out = pa.ragged_paged_attention(q, k, vt, md, interpret=True, poison_output=True, decode_splits=splits,
                                            **kw)
            assert max_rel_err(out, ref, md) <= TOL[jnp.bfloat16]
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
            device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
        fn = jax.jit(functools.partial(pa.ragged_paged_attention, **kw))
        with jax.sharding.use_abstract_mesh(mesh):
            assert "__gpu$xla.gpu.triton" in fn.trace(q, k, vt, md).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="multiple of block_size"):
        pa.ragged_paged_attention(q, k, vt, md, **dict(kw, prefill_block_k=8), interpret=True)


@pytest.mark.parametrize("decode_only", [True, False])
def test_fp8_cache_with_pages_of_128_and_the_mgpu_backend(decode_only):
    """An fp8 cache's transposed V pages with pages of 128 tokens (the CLI allows them): the default key tiles
    grow to a page, decode-only and fused. ``pallas-mgpu`` over an fp8 cache keeps its prefill tokens on the
    Triton tiles (the Mosaic GPU prefill takes no fp8); head-major V pages in an fp8 cache are refused, not
    misread."""
    rng = np.random.default_rng(25)
    q_lens = [1, 1, 1] if decode_only else [1, 9, 1]
    q, k, v, md = synthetic.make_batch(rng, q_lens, [300, 9, 130], block_size=128, num_q_heads=4, num_kv_heads=2,
                                       head_dim=64, dtype=jnp.bfloat16, pad_tokens=2, pad_reqs=1)
    md = dataclasses.replace(md, decode_only=decode_only)
    scale = jnp.asarray([0.5, 1.5], jnp.float32)
    k, v = synthetic.quantize_caches(k, v, jnp.float8_e4m3fn, scale, scale)
    kw = dict(sm_scale=0.125, k_scale=scale, v_scale=scale)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, **kw)
    for backend in ("pallas", "pallas-mgpu"):
        out = ops.paged_attention(q, k, v, md, backend=backend, interpret=True, poison_output=True, **kw)
        assert max_rel_err(out, ref, md) <= 1e-2
    with pytest.raises(ValueError, match="needs V pages"):
        pa.ragged_paged_attention(q, k, jnp.swapaxes(v, 2, 3), md, interpret=True, **kw)


def test_diagonal_at_every_chunk_offset():
    """Prefill chunks whose first query sits at each offset around a 16-key chunk edge: the unmasked
    fast path must stop exactly at the first row's diagonal."""
    check(13, [18] * 5, [31, 32, 33, 34, 35], hq=4, kvh=4, d=64, bs=16, dtype=jnp.float32, splits=1)


def test_window_edge_at_every_chunk_offset():
    """Sliding-window starts at each offset around a 16-key chunk edge (decodes and a prefill chunk)."""
    check(14, [1, 1, 1, 1, 1, 6], [31, 32, 33, 34, 35, 40], hq=4, kvh=2, d=64, bs=16, dtype=jnp.float32,
          window=16, splits=1)


@pytest.mark.parametrize("kvh,cache_dtype", [(3, jnp.bfloat16), (8, jnp.float32), (2, "fp8"), (3, "fp8")])
def test_pallas_write_kv_matches_scatter(kvh, cache_dtype):
    """The one-launch Pallas K/V write (interpret mode) against the XLA scatter: every real slot equal, the
    null block (padding tokens' PAD_SLOT) left untouched, other slots unchanged. kvh=3 is SmolLM2's
    (not a power of two: padded head rows must not be stored). An fp8 cache's V pages are transposed: the
    write stores each head's D values down one column of its page."""
    rng = np.random.default_rng(kvh)
    nb, bs, d, T, n_real = 6, 16, 64, 12, 9
    dtype = jnp.bfloat16 if cache_dtype == "fp8" else cache_dtype
    cdt = ops.kv_cache_dtype(cache_dtype, dtype) if cache_dtype == "fp8" else cache_dtype
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), dtype).astype(cdt)
                        for shape in ops.kv_cache_shapes(nb, bs, kvh, d, cdt))   # fp8: V pages transposed
    k = jnp.asarray(rng.standard_normal((T, kvh, d)) * 3, dtype)
    v = jnp.asarray(rng.standard_normal((T, kvh, d)) * 3, dtype)
    real = rng.choice(np.arange(bs, nb * bs), n_real, replace=False)        # never the null block
    slots = jnp.asarray(np.concatenate([real, np.zeros(T - n_real, np.int64)]), jnp.int32)
    scale = dict(k_scale=jnp.linspace(0.5, 2.0, kvh), v_scale=jnp.float32(0.7)) if cache_dtype == "fp8" else {}
    want_k, want_v = ops.write_kv(k_cache, v_cache, k, v, slots, **scale)
    got_k, got_v = ops.write_kv(k_cache, v_cache, k, v, slots, backend="pallas", interpret=True, **scale)
    for got, want, old in ((got_k, want_k, k_cache), (got_v, want_v, v_cache)):
        assert got.dtype == old.dtype and got.shape == old.shape
        g, w, o = (synthetic.slot_major(x, old is v_cache) for x in (got, want, old))                   # [slot, head, d]
        np.testing.assert_array_equal(g[bs:], w[bs:])               # real slots written, the rest unchanged
        np.testing.assert_array_equal(g[:bs], o[:bs])               # padding tokens wrote nothing
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        ops.write_kv(k_cache, v_cache, k, v, slots, backend="pallas")


@pytest.mark.parametrize("kvh,cache_dtype", [(3, jnp.bfloat16), (8, jnp.float8_e4m3fn)])
def test_pallas_write_kv_lowers_for_cuda(kvh, cache_dtype):
    """The K/V write's Triton build (all heads in one masked [kv_heads_pad, D] load and store) lowers for
    CUDA here on CPU; interpret mode above checks its values."""
    from jaxserve.kernels import kv_write_pallas
    k_cache, v_cache = (jax.ShapeDtypeStruct(shape, cache_dtype)
                        for shape in ops.kv_cache_shapes(64, 16, kvh, 128, cache_dtype))
    new = jax.ShapeDtypeStruct((16, kvh, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((16,), jnp.int32)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):                      # Triton needs a GPU's compute capability
        text = kv_write_pallas.write_kv.trace(k_cache, v_cache, new, new, slots).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


# The Mosaic GPU prefill kernel (kernels/prefill_mgpu.py) in Mosaic GPU's interpret mode: its tile schedule,
# paged TMA reads, causal masks and ragged row stores against the reference. (Interpret mode takes the MMA's
# A operand from shared memory and adds the P.V product after it; on the GPU both stay in the MMA.)
MGPU = dict(prefill_kernel="mgpu", decode_block_k=16)


@pytest.mark.parametrize("q_lens,ctx_lens,hq,kvh,d,bs,block_kv", [
    # tiles that end 1 row short, exactly, and 1 row past a warpgroup's 64; decodes and a 2-token chunk between
    ([64, 1, 63, 65, 2], [64, 3, 100, 65, 40], 4, 2, 64, 16, 64),
    # SmolLM2's GQA group of 3; 32-token pages; a 200-token chunk on a 190-token cached prefix
    pytest.param([1, 200, 1, 5], [30, 390, 7, 300], 9, 3, 64, 32, 128, marks=pytest.mark.slow),   # ~22 s
    # Llama's head_dim 128 with 64-token pages: two pages per K/V step
    ([129, 1], [129, 20], 4, 1, 128, 64, 128),
])
def test_mgpu_prefill_matches_reference(q_lens, ctx_lens, hq, kvh, d, bs, block_kv):
    check(hq + bs, q_lens, ctx_lens, hq=hq, kvh=kvh, d=d, bs=bs, dtype=jnp.bfloat16,
          tiles=dict(MGPU, mgpu_block_kv=block_kv))


def test_mgpu_prefill_scope_and_dispatch():
    """Where the Mosaic GPU kernel does not apply, "mgpu" falls back to the Triton prefill tiles; the
    backend names pin the prefill kernel."""
    from jaxserve.kernels import prefill_mgpu
    rng = np.random.default_rng(4)
    q, k, v, md = synthetic.make_batch(rng, [1, 20], [30, 20], block_size=16, num_q_heads=4, num_kv_heads=2,
                                       head_dim=64, dtype=jnp.bfloat16)
    assert prefill_mgpu.supported(q, k)
    assert not prefill_mgpu.supported(q.astype(jnp.float32), k.astype(jnp.float32))
    assert not prefill_mgpu.supported(q, k, soft_cap=30.0)
    assert not prefill_mgpu.supported(q, k, sliding_window=8)
    assert not prefill_mgpu.supported(q, k.astype(ops.kv_cache_dtype("fp8", jnp.bfloat16)), k_scale=1.0)
    assert not prefill_mgpu.supported(q, k, block_kv=40)
    # head_dim 256 (Gemma) and 3 stages at head_dim 128 do not fit the 227 KiB of shared memory
    q256, k256 = jnp.zeros((8, 4, 256), jnp.bfloat16), jnp.zeros((4, 16, 2, 256), jnp.bfloat16)
    assert not prefill_mgpu.supported(q256, k256)
    q128, k128 = jnp.zeros((8, 4, 128), jnp.bfloat16), jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    assert prefill_mgpu.supported(q128, k128) and not prefill_mgpu.supported(q128, k128, stages=3)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=0.125, soft_cap=30.0)
    out = ops.paged_attention(q, k, v, md, sm_scale=0.125, soft_cap=30.0, backend="pallas-mgpu", interpret=True)
    assert max_rel_err(out, ref, md) <= 1e-2
    ref = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=0.125)
    # f16 matmul operands over a bf16 cache: q no longer matches the cache, so the Triton tiles take it
    out = pa.ragged_paged_attention(q, k, v, md, sm_scale=0.125, interpret=True, prefill_kernel="mgpu",
                                    dot_dtype=jnp.float16)
    assert out.dtype == q.dtype and max_rel_err(out, ref, md) <= 1e-2
    for backend in ("pallas", "pallas-triton", "pallas-mgpu"):
        out = ops.paged_attention(q, k, v, md, sm_scale=0.125, backend=backend, interpret=True)
        assert max_rel_err(out, ref, md) <= 1e-2, backend
