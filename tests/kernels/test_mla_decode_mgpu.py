"""The Mosaic GPU paged MLA decode kernel (``kernels/mla_decode_mgpu.py``) against the float64 reference of
``test_mla_decode`` (each request's pages gathered by hand).

Interpret mode on CPU: random ragged decode steps (odd context lengths, many shuffled pages, a shared prefix
page, padding tokens and requests), several splits (empty ones included), pages smaller than, equal to and
larger than a K/V step, more steps than ring slots (so slots are refilled), and two head groups. Interpret mode
checks that every barrier phase is observed in order; its race detector (``detect_races``) that no
shared-memory buffer is rewritten while a TMA copy or MMA still uses it. Then the GPU build lowers for CUDA on
CPU at DeepSeek's shapes (the lowering checks the shared-memory limit), and, marked ``gpu``, the compiled kernel
against the reference.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.kernels import mla_decode_mgpu as mgpu
from test_mla_decode import make_step, mla_reference, rel_err

RACES = plgpu.InterpretGPUParams(detect_races=True)     # prints "RACE DETECTED" for each race
H200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


def check(seed, q_lens, ctx_lens, *, heads, rank=128, rope=64, bs=16, decode_only=True, pad_tokens=3,
          interpret=RACES, capsys=None, tol=1e-2, dtype=jnp.bfloat16, **launch):
    qn, qr, latent, md = make_step(seed, q_lens, ctx_lens, heads=heads, rank=rank, rope=rope, bs=bs,
                                   dtype=dtype, pad_tokens=pad_tokens, decode_only=decode_only)
    sm_scale = (rank + rope) ** -0.5
    assert mgpu.supported(qn, qr, latent, **launch)
    out = mgpu.mla_paged_attention(qn, qr, latent, md, sm_scale=sm_scale, interpret=interpret, **launch)
    if capsys is not None:
        assert "RACE DETECTED" not in capsys.readouterr().out
    assert out.shape == qn.shape and out.dtype == qn.dtype
    ref = mla_reference(qn, qr, latent, md, sm_scale=sm_scale)
    err = rel_err(out, ref, md)
    assert err <= tol, f"max rel err {err:.2e}"
    n_real = int(md.query_start_loc[int(md.num_seqs)])
    assert not np.asarray(out[n_real:], np.float32).any(), "padding tokens' rows must be zero"
    return out


DECODE = ([1] * 5, [1, 17, 150, 333, 64])     # a 1-token context, ragged last pages, 21 pages, one whole step


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_steps_and_splits(splits, capsys):
    """6 steps of 64 keys through 2 slots (each slot refilled twice); 4 splits: empty splits for short contexts."""
    check(splits, *DECODE, heads=16, num_splits=splits, capsys=capsys)


@pytest.mark.parametrize("bs,block_kv,stages", [(8, 64, 3), (64, 64, 2), (128, 64, 2)])
def test_pages_smaller_equal_and_larger_than_a_step(bs, block_kv, stages, capsys):
    """8 pages a step (16 TMA copies on a slot's barrier) over 3 slots; one page a step; half a page a step."""
    check(bs, [1, 1, 1], [200, 129, 64], heads=16, bs=bs, block_kv=block_kv, stages=stages, num_splits=2,
          capsys=capsys)


def test_two_head_groups_of_8(capsys):
    """16 heads as two programs of 8 (the MMAs' N = 8) reading the same pages; one slot, 128-key steps."""
    check(3, [1, 1, 1], [300, 7, 130], heads=16, block_h=8, block_kv=128, stages=1, num_splits=2, capsys=capsys)


def test_prefill_chunk_tokens_are_causal():
    """q_len > 1 beside decodes (not decode-only: tokens find their request by search): each token sees the keys
    up to its own position, one program per token; f16."""
    check(4, [1, 5, 1], [70, 80, 9], heads=8, decode_only=False, num_splits=2, dtype=jnp.float16, tol=2e-3)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_steps(seed):
    """Drawn at random: heads (8 to 32 by 8), R, page size, up to 5 requests of random context, splits (the
    default's included), a host bound on the contexts."""
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(1, 6))
    ctx = rng.integers(1, 400, n)
    qn, qr, latent, md = make_step(seed, [1] * n, ctx, heads=int(rng.choice([8, 16, 24, 32])),
                                   rank=int(rng.choice([64, 128])), rope=64, bs=int(rng.choice([8, 16, 32])),
                                   dtype=jnp.bfloat16, decode_only=True, pad_tokens=int(rng.integers(0, 3)))
    md = dataclasses.replace(md, max_seq_len=int(ctx.max()) if rng.integers(2) else None)
    launch = dict(num_splits=[None, 1, 2, 8][int(rng.integers(4))])
    out = mgpu.mla_paged_attention(qn, qr, latent, md, sm_scale=0.07, interpret=True, **launch)
    err = rel_err(out, mla_reference(qn, qr, latent, md, sm_scale=0.07), md)
    assert err <= 1e-2, (ctx.tolist(), qn.shape, latent.shape, launch, err)


def test_supported_and_default_launch():
    """The caller's fallback: fp8 caches, a kv_scale, heads not a multiple of 8, R not a multiple of 64 and
    shared memory beyond 227 KiB go to the Triton kernel. DeepSeek's latent fits 2 slots of 64 keys; a split's
    float32 state tile takes 32 heads past the limit, so split 128-head steps run 16 heads a program."""
    qn, qr, latent, md = make_step(0, [1], [5], heads=16, rank=512, rope=64, bs=16, dtype=jnp.bfloat16)
    assert mgpu.supported(qn, qr, latent)
    assert not mgpu.supported(qn, qr, latent.astype(jnp.float8_e4m3fn))
    assert not mgpu.supported(qn, qr, latent, kv_scale=jnp.float32(0.5))
    assert not mgpu.supported(qn[:, :12], qr[:, :12], latent)
    assert not mgpu.supported(qn, qr, latent, stages=3)
    assert not mgpu.supported(qn.astype(jnp.float32), qr.astype(jnp.float32), latent.astype(jnp.float32))
    assert not mgpu.supported(qn[..., :96], qr, latent[..., 32:])
    assert mgpu.default_launch(64, 16, 512, 64, 4096) == (16, 2)      # 64 programs: 2 splits fill 128 SMs
    assert mgpu.default_launch(64, 128, 512, 64, 4096) == (32, 1)     # 256 programs: no split
    assert mgpu.default_launch(4, 128, 512, 64, 4096) == (16, 4)      # split: 32 heads' state does not fit
    with pytest.raises(ValueError, match="mla_decode_pallas"):
        mgpu.mla_paged_attention(qn, qr, latent, md, sm_scale=0.1, stages=3, interpret=True)


@pytest.mark.parametrize("heads,bs,splits", [(16, 16, 1), (16, 16, 2), (128, 16, 1), (128, 64, 4), (16, 64, None)])
def test_lowers_for_cuda(heads, bs, splits):
    """The GPU build at DeepSeek's latent (R 512, P 64) lowers to Mosaic GPU for CUDA on CPU, within the
    shared-memory limit the lowering checks."""
    qn, qr, latent, md = make_step(1, [1] * 4, [40, 9, 17, 300], heads=heads, rank=512, rope=64, bs=bs,
                                   dtype=jnp.bfloat16, decode_only=True)
    step = jax.jit(lambda *a: mgpu.mla_paged_attention(*a, sm_scale=0.1, num_splits=splits))
    with jax.sharding.use_abstract_mesh(H200):
        text = step.trace(qn, qr, latent, md).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda pytest -m gpu)")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("bs", [16, 64])
def test_matches_the_reference_on_the_gpu(heads, bs):
    """The compiled kernel at DeepSeek's shape, on its default launch and with 4 splits."""
    for splits in (None, 4):
        check(heads, [1] * 6, [700, 33, 1, 300, 17, 2049], heads=heads, rank=512, rope=64, bs=bs, interpret=False,
              num_splits=splits)
