"""The int4 W4A16 Pallas kernel (interpret mode) and the jnp dequantization against a numpy reference, on
random shapes: groups of 32 / 64 / 128 and per-channel, odd M, N tails the block sizes must divide, split-K."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax.numpy as jnp

from jaxserve.kernels import int4_matmul_pallas as k4
from jaxserve.quantization import int4_formats
from jaxserve.quantization.weights import Fp8Weight, _fp8_matmul, quantize_activation_per_token


def random_int4(rng, k: int, n: int, group: int):
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (rng.random((k // group, n)) * 0.02 + 0.001).astype(np.float16)
    zeros = rng.integers(0, 16, (k // group, n)).astype(np.int8)
    w = ((q.astype(np.float32) - np.repeat(zeros, group, 0)) * np.repeat(scales.astype(np.float32), group, 0))
    return int4_formats.pack(q), scales, zeros, w.astype(np.float32)


def test_pack_and_dequantize_are_exact():
    rng = np.random.default_rng(0)
    packed, scales, zeros, w = random_int4(rng, 256, 40, 64)
    np.testing.assert_array_equal(np.asarray(k4.unpack_int4(jnp.asarray(packed))),
                                  int4_formats._unpack_first(packed))
    np.testing.assert_array_equal(np.asarray(k4.dequantize_int4(packed, scales, zeros, 64)), w)


CASES = [  # m, k, n, group, config
    (1, 256, 64, 128, k4.Config("fma", block_n=64)),
    (4, 1024, 64, 128, k4.Config("fma", block_n=32, unroll=2)),             # split K and paired loads
    (3, 384, 48, 32, k4.Config("fma", block_n=16, split_k=1)),
    (2, 512, 96, 64, k4.Config("fma", block_n=32, split_k=2, unroll=2)),
    (7, 256, 32, 256, k4.Config("fma", block_n=32)),                        # per-channel: 128-row slices
    (1, 256, 64, 128, k4.Config("dot", block_n=64)),
    (5, 384, 48, 32, k4.Config("dot", block_n=16, split_k=1)),
    (3, 512, 96, 64, k4.Config("dot", block_n=32, split_k=2)),
    (20, 256, 32, 256, k4.Config("dot", block_n=32)),
    (33, 1024, 16, 128, k4.Config("dot", block_n=16, split_k=4, unroll=2)),
    (1, 256, 64, 128, k4.Config("gemv", block_n=64)),
    (4, 1024, 64, 128, k4.Config("gemv", block_n=32, unroll=2, block_k=64)),   # split K, 64-row steps
    (3, 384, 48, 32, k4.Config("gemv", block_n=16, split_k=1)),
    (8, 512, 96, 64, k4.Config("gemv", block_n=32, split_k=2, block_k=32)),
    (5, 256, 32, 256, k4.Config("gemv", block_n=32, block_k=64)),              # per-channel in 64-row steps
]


@pytest.mark.parametrize("m,k,n,group,config", CASES)
def test_kernel_matches_the_reference_in_interpret_mode(m, k, n, group, config):
    rng = np.random.default_rng(m * 7 + n)
    packed, scales, zeros, w = random_int4(rng, k, n, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x @ w
    assert k4.supports(m, k, n, group, interpret=True, method=config.method)
    got = k4.int4_matmul(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(zeros),
                         group_size=group, config=config, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    ref = k4.int4_matmul_reference(jnp.asarray(x), packed, scales, zeros, group)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)


def test_dequantized_planes_are_exact():
    """The mantissa trick reads every nibble back exactly, less its zero point, the top nibbles (sign bit
    included) too."""
    words = jnp.asarray(np.array([[0x76543210, -0x12345679, -1, 0]], np.int64).astype(np.int32))
    zeros = np.array([[3.0, 0.0, 15.0, 7.0]], np.float32)
    got = np.stack([np.asarray(w * inv) for w, inv in k4._planes(words, jnp.asarray(zeros))], axis=-1)  # [1, 4, 8]
    want = np.asarray(k4.unpack_int4(words)).reshape(8, 4).T - zeros.reshape(4, 1)
    np.testing.assert_array_equal(got.reshape(4, 8), want)


def test_exact_planes_are_q_minus_z_with_no_power_of_two():
    words = jnp.asarray(np.array([[0x76543210, -0x12345679, -1, 0]], np.int64).astype(np.int32))
    zeros = np.array([[3.0, 0.0, 15.0, 7.0]], np.float32)
    got = np.stack([np.asarray(w) for w in k4._exact_planes(words, k4._plane_bias(jnp.asarray(zeros)))], -1)
    want = np.asarray(k4.unpack_int4(words)).reshape(8, 4).T - zeros.reshape(4, 1)
    np.testing.assert_array_equal(got.reshape(4, 8), want)


@pytest.mark.parametrize("live", [1, 3])
def test_gemv_live_rows_computes_the_live_rows_and_zeros_the_padding(live):
    rng = np.random.default_rng(11)
    packed, scales, zeros, w = random_int4(rng, 512, 64, 128)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    want = x @ w
    if live == 1:            # one live row runs the one-row loop; the bucket's padding rows come back zero
        want[1:] = 0
    got = k4.int4_matmul(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(zeros),
                         group_size=128, config=k4.Config("gemv", block_n=32, block_k=64), interpret=True,
                         live_rows=jnp.int32(live))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("method", k4.METHODS)
def test_kernel_bfloat16(method):
    rng = np.random.default_rng(3)
    packed, scales, zeros, w = random_int4(rng, 512, 64, 128)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    got = k4.int4_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(packed), jnp.asarray(scales),
                         jnp.asarray(zeros), group_size=128, config=k4.Config(method, block_n=64), interpret=True)
    assert got.dtype == jnp.bfloat16
    want = x @ w
    assert np.abs(np.asarray(got, np.float32) - want).max() < 0.02 * np.abs(want).max()


def test_default_launch_in_interpret_mode():
    rng = np.random.default_rng(5)
    packed, scales, zeros, w = random_int4(rng, 512, 256, 128)
    for m in (1, 4, 9):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        got = k4.int4_matmul(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(zeros),
                             group_size=128, interpret=True)
        np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-4)


def test_gpu_path_declines_what_triton_cannot_tile():
    assert not k4.supports(16, 256, 64, 64, method="dot")   # K steps of 64 rows: plane dots of 8 (< 16)
    assert k4.supports(1, 256, 64, 64, method="fma")         # the fma kernel has no dot to feed
    assert not k4.supports(1, 256, 24, 128)                  # no block of 16+ columns divides 24
    assert not k4.supports(1, 288, 64, 96)                   # a 96-row group: 12 packed rows, not a power of 2
    assert not k4.supports(17, 4096, 14336, 128, method="fma")
    assert k4.supports(1, 4096, 14336, 128) and k4.supports(64, 4096, 14336, 128)


def test_fp8_w8a8_matmul_is_the_scaled_fp8_product():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    wq = (rng.standard_normal((256, 64)) * 100).astype(jnp.float8_e4m3fn)
    scale = (rng.random(64) * 0.01).astype(np.float32)
    stored = jnp.asarray(np.ascontiguousarray(wq.T))          # output-major
    got = _fp8_matmul(jnp.asarray(x), Fp8Weight(weight=stored, scale=jnp.asarray(scale), input_scale=None), 64)
    xq, sx = quantize_activation_per_token(jnp.asarray(x))
    want = (np.asarray(xq, np.float32) @ np.asarray(wq, np.float32)) * np.asarray(sx) * scale
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # the activation quantization itself: each row's largest magnitude maps to e4m3's 448
    np.testing.assert_allclose(np.abs(np.asarray(xq, np.float32)).max(1), 448.0)


def test_tuned_launches_file_drives_the_default_launch(tmp_path, monkeypatch):
    from jaxserve.benchmarks import int4_launches as bench
    path = tmp_path / "int4_launches.json"
    gemv = k4.Config("gemv", block_n=256, block_k=64, num_warps=1)
    bench.write_launches(str(path), [{"key": k4.launch_key(4096, 28672, 4, True), "us": 1.0,
                                      "config": dataclasses.asdict(gemv)}])
    monkeypatch.setattr(k4, "LAUNCHES_FILE", path)
    k4.tuned_launches.cache_clear()
    try:
        assert k4.default_config(4, 4096, 28672, 128, live_one=True) == gemv
        assert k4.default_config(4, 4096, 28672, 128).method == "dot"        # no entry: the heuristic
    finally:
        k4.tuned_launches.cache_clear()
