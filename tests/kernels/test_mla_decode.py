"""The paged MLA decode kernel (``kernels/mla_decode_pallas.py``, interpret mode on CPU) against a naive
reference written here: each request's pages gathered, scores and softmax in float64 numpy.

Steps are random ragged batches (odd lengths, many pages shuffled over the pool, a shared prefix page,
padding tokens and requests); outputs start NaN-poisoned, so a row no kernel writes fails. Error:
max |out - ref| / max |ref| over the real tokens' rows.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import synthetic
from jaxserve.kernels import mla_decode_pallas as mla
from jaxserve.kernels.ref_attention import FP8_DTYPE, FP8_MAX

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}


def mla_reference(q_nope, q_rope, latent, md, *, sm_scale, kv_scale=None):
    """Naive absorbed MLA: token t of request r sees the request's latents 0..its position; float64."""
    qn, qr = np.asarray(q_nope, np.float64), np.asarray(q_rope, np.float64)
    lat = np.asarray(latent.astype(jnp.float32), np.float64) * (1.0 if kv_scale is None else float(kv_scale))
    R, bs = qn.shape[-1], lat.shape[1]
    qsl, seq_lens = np.asarray(md.query_start_loc), np.asarray(md.seq_lens)
    tables = np.asarray(md.block_tables)
    out = np.zeros(qn.shape, np.float64)
    for r in range(int(md.num_seqs)):
        n = int(seq_lens[r])
        rows = lat[tables[r, :-(-n // bs)]].reshape(-1, lat.shape[-1])[:n]
        c_kv, k_rope = rows[:, :R], rows[:, R:]
        for t in range(qsl[r], qsl[r + 1]):
            pos = n - (qsl[r + 1] - t)
            s = sm_scale * (qn[t] @ c_kv[:pos + 1].T + qr[t] @ k_rope[:pos + 1].T)       # [H, pos + 1]
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[t] = (p / p.sum(axis=-1, keepdims=True)) @ c_kv[:pos + 1]
    return out


def make_step(seed, q_lens, ctx_lens, *, heads, rank, rope, bs, dtype, pad_tokens=3, pad_reqs=1, decode_only=False):
    """q_nope [T, H, R], q_rope [T, H, P], latent cache [num_blocks, bs, R + P], metadata."""
    rng = np.random.default_rng(seed)
    q, k, _, md = synthetic.make_batch(rng, q_lens, ctx_lens, block_size=bs, num_q_heads=heads, num_kv_heads=1,
                                       head_dim=rank + rope, dtype=dtype, pad_tokens=pad_tokens, pad_reqs=pad_reqs)
    return q[..., :rank], q[..., rank:], k[:, 0], dataclasses.replace(md, decode_only=decode_only)


def rel_err(out, ref, md):
    n_real = int(md.query_start_loc[int(md.num_seqs)])
    out = np.asarray(out, np.float32)[:n_real]
    assert not np.isnan(out).any(), "NaN in output: a row was never written"
    return float(np.abs(out - ref[:n_real]).max() / np.abs(ref[:n_real]).max())


def check(seed, q_lens, ctx_lens, *, heads, rank, rope, bs, dtype=jnp.float32, fp8_scale=None, tol=None,
          decode_only=False, pad_tokens=3, interpret=True, **kw):
    qn, qr, latent, md = make_step(seed, q_lens, ctx_lens, heads=heads, rank=rank, rope=rope, bs=bs, dtype=dtype,
                                   pad_tokens=pad_tokens, decode_only=decode_only)
    if fp8_scale is not None:
        latent = jnp.clip(latent.astype(jnp.float32) / fp8_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
        kw["kv_scale"] = jnp.float32(fp8_scale)
    sm_scale = (rank + rope) ** -0.5
    ref = mla_reference(qn, qr, latent, md, sm_scale=sm_scale, kv_scale=kw.get("kv_scale"))
    kw["interpret"] = interpret
    out = mla.mla_paged_attention(qn, qr, latent, md, sm_scale=sm_scale, poison_output=True, **kw)
    assert out.shape == qn.shape and out.dtype == qn.dtype
    n_real = int(md.query_start_loc[int(md.num_seqs)])
    assert not np.asarray(out[n_real:], np.float32).any(), "padding tokens' rows must stay zero"
    err = rel_err(out, ref, md)
    assert err <= (tol or TOL[dtype]), f"max rel err {err:.2e}"
    # the engine's call: no buffer passed in, real rows the same
    plain = mla.mla_paged_attention(qn, qr, latent, md, sm_scale=sm_scale, **kw)
    np.testing.assert_array_equal(np.asarray(plain[:n_real], np.float32), np.asarray(out[:n_real], np.float32))


DECODE = ([1] * 5, [1, 17, 150, 333, 64])


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_only_f32(splits):
    """Odd lengths over many shuffled pages (a 1-token context, a ragged last page, 21 pages); empty splits."""
    check(splits, *DECODE, heads=16, rank=128, rope=32, bs=16, decode_only=True, num_splits=splits)


def test_decode_bf16_two_head_groups_and_splits():
    """32 heads in two programs of 16 (each reading the same pages), 2 splits, pages of 32, R 256 / P 64."""
    check(2, [1, 1, 1], [97, 200, 31], heads=32, rank=256, rope=64, bs=32, dtype=jnp.bfloat16, decode_only=True,
          block_h=16, num_splits=2)


@pytest.mark.parametrize("splits", [1, 2])
def test_prefill_chunks_with_decodes(splits):
    """q_len > 1 (a whole prompt, a chunk over a cached prefix) beside decodes: each token causal at its own
    position; 8 heads padded to a 16-row tile; not decode-only, so tokens find their request by search."""
    check(10 + splits, [1, 9, 1, 20], [45, 9, 70, 53], heads=8, rank=128, rope=32, bs=16, num_splits=splits)


@pytest.mark.parametrize("block_t,heads", [(2, 8), (4, 16), (8, 4)])
def test_prefill_tiles(block_t, heads):
    """Tiles of ``block_t`` tokens of one request: chunks that start and end mid-tile, tiles two requests share,
    decodes (one token of a tile), a step not a whole number of tiles (padded), causal within each tile."""
    check(20 + block_t, [1, 9, 1, 20, 3, 6], [45, 9, 70, 53, 3, 40], heads=heads, rank=128, rope=32, bs=16,
          block_t=block_t, block_k=16)


def test_heads_not_a_power_of_two_and_default_launch():
    """20 heads (a 32-row tile, 12 padding rows) on the default tiles and split count."""
    check(4, [1, 3, 1], [130, 40, 7], heads=20, rank=128, rope=32, bs=16)


@pytest.mark.parametrize("bs,block_k", [(64, 16), (8, 32)])
def test_pages_larger_and_smaller_than_a_step(bs, block_k):
    """A step inside one page (pages of 64, 16-key steps) and a step over four pages (pages of 8)."""
    check(5 + bs, *DECODE, heads=16, rank=128, rope=32, bs=bs, decode_only=True, block_k=block_k, num_splits=2)


@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_latent_cache(splits):
    """e4m3 latents with a per-tensor scale, bf16 queries (f16 MMAs), against the dequantized cache."""
    check(6, [1, 1, 4, 1], [90, 33, 20, 150], heads=16, rank=128, rope=64, bs=16, dtype=jnp.bfloat16,
          fp8_scale=0.05, num_splits=splits)


def test_deepseek_shape():
    """R 512, P 64, 128 heads (two programs of 64), bf16, block_size 16."""
    check(7, [1, 1], [40, 75], heads=128, rank=512, rope=64, bs=16, dtype=jnp.bfloat16, decode_only=True,
          pad_tokens=1, num_splits=2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_shapes(seed):
    """Drawn at random: R, P, heads (any count from 1), page size, up to 5 requests of random context, decode
    or a chunk, split count (the default included), keys per step, and a host bound on the contexts."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 6))
    ctx = rng.integers(1, 260, n)
    decode = bool(rng.integers(2))
    q_lens = [1 if decode else int(rng.integers(1, min(c, 12) + 1)) for c in ctx]
    launch = dict(num_splits=[None, 1, 2, 8][int(rng.integers(4))], block_k=int(rng.choice([16, 32])))
    qn, qr, latent, md = make_step(seed, q_lens, ctx, heads=int(rng.integers(1, 41)), rank=int(rng.choice([128, 256])),
                                   rope=int(rng.choice([32, 64])), bs=int(rng.choice([8, 16, 32])),
                                   dtype=jnp.float32, decode_only=decode)
    md = dataclasses.replace(md, max_seq_len=int(ctx.max()) if rng.integers(2) else None)
    ref = mla_reference(qn, qr, latent, md, sm_scale=0.07)
    out = mla.mla_paged_attention(qn, qr, latent, md, sm_scale=0.07, interpret=True, poison_output=True, **launch)
    assert rel_err(out, ref, md) <= 1e-4, (q_lens, ctx.tolist(), qn.shape, qr.shape, latent.shape, launch)


def test_rejects_mismatched_shapes():
    qn, qr, latent, md = make_step(0, [1], [5], heads=16, rank=128, rope=32, bs=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla.mla_paged_attention(qn, qr, latent, md, sm_scale=0.1, kv_lora_rank=256, interpret=True)
    with pytest.raises(ValueError, match="R \\+ P"):
        mla.mla_paged_attention(qn, qr[..., :16], latent, md, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        mla.mla_paged_attention(qn[..., :96], qr, latent[..., 32:], md, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="num_splits"):
        mla.mla_paged_attention(qn, qr, latent, md, sm_scale=0.1, interpret=True, num_splits=3)


def test_split_count_fills_the_chip():
    """Few programs get splits (each >= MIN_SPLIT_KEYS keys), a full chip none (132 SMs)."""
    assert mla.pick_splits(64, 4096, 32, programs_per_sm=2) == 4        # 64 tokens x 1 head group: 256 programs
    assert mla.pick_splits(128, 4096, 32, programs_per_sm=1) == 1       # 64 tokens x 2 groups of 64 heads
    assert mla.pick_splits(1, 4096, 32, programs_per_sm=2) == 16        # capped at 256 keys a split
    assert mla.pick_splits(1, 513, 32, programs_per_sm=2) == 2
    # within the runner's short-context bound: splits of at least 128 keys while the chip is mostly idle
    assert mla.pick_splits(1, 512, 32, programs_per_sm=2) == 4
    assert mla.pick_splits(1, 300, 32, programs_per_sm=2) == 2
    assert mla.pick_splits(1, 200, 32, programs_per_sm=2) == 1
    assert mla.pick_splits(16, 512, 32, programs_per_sm=2) == 4         # 16 of 132 SMs busy
    assert mla.pick_splits(17, 512, 32, programs_per_sm=2) == 1


@pytest.mark.parametrize("heads,fp8,decode_only,splits", [(128, False, True, 1), (16, False, True, 4),
                                                         (16, True, True, 2), (128, True, False, 2),
                                                         (16, False, False, 1)])
def test_lowers_for_cuda(heads, fp8, decode_only, splits):
    """The GPU build (Triton) of the DeepSeek shape lowers here on CPU: bf16 and fp8 caches, both launches,
    and the prefill tiles (16 heads x 4 tokens a program)."""
    qn, qr, latent, md = make_step(1, [1] * 4 if decode_only else [1, 9], [40, 9, 17, 300] if decode_only else
                                   [40, 300], heads=heads, rank=512, rope=64, bs=16, dtype=jnp.bfloat16,
                                   decode_only=decode_only)
    if fp8:
        latent = latent.astype(FP8_DTYPE)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    step = jax.jit(lambda *a: mla.mla_paged_attention(*a, sm_scale=0.1, num_splits=splits,
                                                      kv_scale=jnp.float32(0.5) if fp8 else None))
    with jax.sharding.use_abstract_mesh(mesh):
        text = step.trace(qn, qr, latent, md).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == (1 if splits == 1 else 2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda pytest -m gpu)")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("decode_only", [True, False])
def test_matches_the_reference_on_the_gpu(heads, fp8, decode_only):
    """The compiled kernel at DeepSeek's shape on the default launch (its own split count) and with splits."""
    q_lens, ctx_lens = ([1] * 6, [700, 33, 1, 300, 17, 2049]) if decode_only else ([1, 37, 1, 130], [700, 37, 1, 300])
    for splits in (None, 4):
        check(heads, q_lens, ctx_lens, heads=heads, rank=512, rope=64, bs=16, dtype=jnp.bfloat16,
              fp8_scale=0.05 if fp8 else None, decode_only=decode_only, num_splits=splits, interpret=False)


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_launch_defaults_fit_shared_memory(heads):
    """The 16-bit and fp8 defaults stay as swept; a float32 launch (the tests' dtype) sheds keys a step until
    its query tile and staged key tiles fit an SM (a 64-row float32 prefill tile at 32 keys did not compile)."""
    width = 576
    for tiles in (mla.default_tiles(heads, False), mla.prefill_tiles(heads, False)):
        assert mla.fit_shared(tiles, width, 2, 2) == tiles
    for tiles in (mla.default_tiles(heads, True), mla.prefill_tiles(heads, True)):
        assert mla.fit_shared(tiles, width, 2, 1) == tiles
    wide = mla.fit_shared(mla.prefill_tiles(heads, False), width, 4, 4)
    assert wide["block_k"] == 16 and wide["num_stages"] == 2
    rows = wide.get("block_t", 1) * wide["block_h"]
    assert (rows * 4 + wide["num_stages"] * wide["block_k"] * 4) * width <= mla.SHARED_MEMORY
