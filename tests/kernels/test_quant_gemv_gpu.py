"""The CUDA quantized GEMVs (``kernels/quant_gemv.cu``) on an NVIDIA GPU against exact products and the jnp
references. int4:
random shapes with K and N tails (K not a multiple of the blocks' K ranges, N not of the 32-column tiles),
groups of 32 / 64 / 128, zero points random or the symmetric 8, scales bf16 / f16 / f32, M = 1, 3, 16, chunks
of 4 and 8 steps, K split across blocks or not (more splits than chunks too), every kernel variant
(``quant_gemv.VARIANTS``; groups of 256 too, M = 8 as well); the engine's int4 matmul taking it with
``JAXSERVE_INT4_FFI_GEMV=1`` (and ``JAXSERVE_INT4_GEMV_VARIANT=occ4``). fp8 (e4m3, W8A16): channel and
128 x 128-block scales, K a multiple of 64 but not of 128, N tails, M = 1, 3, 16; the engine's fp8 matmul taking
it (the default, ``JAXSERVE_FP8_FFI_GEMV=1``). Marked ``gpu``; on a GPU host with nvcc:

    JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/kernels/test_quant_gemv_gpu.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import int4_matmul_pallas as k4, quant_gemv
from jaxserve.quantization import int4_formats

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu",
                                 reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda pytest -m gpu)")]


@pytest.fixture(scope="module", autouse=True)
def built():
    from jaxserve.parallel.collectives import kernel_toolchain
    try:
        quant_gemv.load(kernel_toolchain())
    except quant_gemv.QuantGemvUnavailable as e:
        pytest.skip(f"the CUDA GEMV cannot run here: {e}")


def _weight(rng, k, n, group, scale_dtype, symmetric):
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (rng.random((k // group, n)) * 0.02 + 0.001).astype(scale_dtype)
    zeros = (np.full((k // group, n), 8) if symmetric else rng.integers(0, 16, (k // group, n))).astype(np.int8)
    w = (q.astype(np.float64) - np.repeat(zeros, group, 0)) * np.repeat(scales.astype(np.float64), group, 0)
    return (jnp.asarray(int4_formats.pack(q)), jnp.asarray(scales), jnp.asarray(zeros)), w


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-30))


CASES = [  # k, n, group: K and N tails
    (4096, 4096, 128), (480, 200, 32), (448, 72, 64), (1152, 1000, 128), (14336, 264, 128), (96, 8, 32),
]


@pytest.mark.parametrize("k,n,group", CASES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_matches_the_exact_product_and_the_reference(k, n, group, m, symmetric):
    rng = np.random.default_rng(k + n + m + symmetric)
    scale_dtype = (np.float16, jnp.bfloat16, np.float32)[(k + m) % 3]
    args, w = _weight(rng, k, n, group, scale_dtype, symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ w
    for chunk, splits in ((None, None), (4, 1), (4, 3), (8, 1), (8, 2), (8, 5)):
        f = jax.jit(lambda x, *a, s=splits, c=chunk: quant_gemv.int4_gemv(x, *a, group_size=group, splits=s, chunk=c))
        got = f(x, *args)
        assert got.shape == (m, n) and got.dtype == jnp.bfloat16
        assert _rel_err(got, exact) < 4e-3, (chunk, splits, _rel_err(got, exact))
        assert _rel_err(got, k4.int4_matmul_reference(x, *args, group)) < 1e-2


VARIANT_CASES = CASES + [(1024, 136, 256)]   # + groups of 256


@pytest.mark.parametrize("variant", [v for v in quant_gemv.VARIANTS if v != "v1"])
@pytest.mark.parametrize("k,n,group", VARIANT_CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_every_variant_matches_the_exact_product_and_the_reference(variant, k, n, group, m, symmetric):
    """The occupancy variants (K and N tails, more splits than chunks) against the exact product and the
    reference."""
    rng = np.random.default_rng(k + n + m + symmetric)
    scale_dtype = (np.float16, jnp.bfloat16, np.float32)[(k + m) % 3]
    args, w = _weight(rng, k, n, group, scale_dtype, symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ w
    for splits in (None, 1, 3, 7):
        f = jax.jit(lambda x, *a, s=splits: quant_gemv.int4_gemv(x, *a, group_size=group, splits=s, variant=variant))
        got = f(x, *args)
        assert got.shape == (m, n) and got.dtype == jnp.bfloat16
        assert np.isfinite(np.asarray(got, np.float32)).all(), splits
        assert _rel_err(got, exact) < 4e-3, (splits, _rel_err(got, exact))
        assert _rel_err(got, k4.int4_matmul_reference(x, *args, group)) < 1e-2


def test_an_unknown_variant_is_refused():
    x = jnp.zeros((1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="variant"):
        quant_gemv.int4_gemv(x, jnp.zeros((8, 8), jnp.int32), jnp.zeros((2, 8), jnp.bfloat16),
                             jnp.zeros((2, 8), jnp.int8), group_size=32, variant="nope")


@pytest.mark.parametrize("variant", quant_gemv.VARIANTS)
def test_repeated_calls_in_one_program_are_deterministic(variant):
    """Split-K calls back to back (each last block resets its counters for the next call) give the same bits."""
    rng = np.random.default_rng(0)
    args, _ = _weight(rng, 4096, 6144, 128, jnp.bfloat16, False)
    x = jnp.asarray(rng.standard_normal((4, 4096)), jnp.bfloat16)
    f = jax.jit(lambda x, *a: [quant_gemv.int4_gemv(x, *a, group_size=128, splits=4, chunk=8, variant=variant)
                               for _ in range(20)])
    outs = [np.asarray(o, np.float32) for o in f(x, *args) + f(x, *args)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("variant", [None, "occ4"])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_engine_matmul_runs_it_when_switched_on(m, variant, monkeypatch):
    from jaxserve.quantization import online, weights
    monkeypatch.setenv("JAXSERVE_INT4_FFI_GEMV", "1")
    if variant:
        monkeypatch.setenv("JAXSERVE_INT4_GEMV_VARIANT", variant)
    k, n, group = 4096, 4096, 128
    w = online.quantize_int4(jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16) * 0.02, group, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    assert weights.int4_step_kernel(m, k, n, group, x.dtype) == "ffi"
    f = jax.jit(weights.matmul)
    assert quant_gemv.TARGET_INT4 in f.lower(x, w).as_text()
    want = k4.int4_matmul_reference(x, w.packed, w.scales, w.zeros, group)
    assert _rel_err(f(x, w), want) < 1e-2


FP8_CASES = [(4096, 4096), (448, 200), (1152, 1000), (14336, 264), (64, 8)]     # k, n: K and N tails


@pytest.mark.parametrize("k,n", FP8_CASES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("block", [False, True])
def test_fp8_matches_the_exact_product(k, n, m, block):
    rng = np.random.default_rng(k + n + m + block)
    w8 = jnp.asarray(rng.standard_normal((n, k)) * 8, jnp.float8_e4m3fn)
    shape = (-(-k // 128), -(-n // 128)) if block else (n,)
    scale = jnp.asarray(rng.random(shape) * 0.02 + 0.001, jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wf = np.asarray(w8, np.float64)
    s = np.asarray(scale, np.float64)
    wf = wf * (np.repeat(np.repeat(s, 128, 0)[:k], 128, 1)[:, :n].T if block else s[:, None])
    exact = np.asarray(x, np.float64) @ wf.T
    for splits in (None, 1, 3):
        if splits and splits > k // quant_gemv.FP8_STEP_K:
            continue
        got = jax.jit(lambda x, w, sc, s=splits: quant_gemv.fp8_gemv(x, w, sc, splits=s))(x, w8, scale)
        assert got.shape == (m, n) and got.dtype == jnp.bfloat16
        assert _rel_err(got, exact) < 4e-3, (splits, _rel_err(got, exact))


@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_engine_fp8_matmul_runs_it_when_switched_on(m, monkeypatch):
    from jaxserve.quantization import online, weights
    monkeypatch.setenv("JAXSERVE_FP8_FFI_GEMV", "1")
    k, n = 4096, 4096
    w = online.quantize_fp8_per_channel(jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16) * 0.02)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    assert weights.fp8_step_uses_gemv(m)
    f = jax.jit(weights.matmul)
    assert quant_gemv.TARGET_FP8 in f.lower(x, w).as_text()
    want = np.asarray(x, np.float64) @ (np.asarray(w.weight, np.float64) * np.asarray(w.scale)[:, None]).T
    assert _rel_err(f(x, w), want) < 4e-3
