"""The quantized matmul's paths beyond the kernels: a step dequantizes one layer's int4 weights at a time (XLA
must not hoist every layer's bf16 copy to the start of the forward: an 8B int4 engine ran out of memory on an
H200 that way), and fp8 weights run weight-only (W8A16) for steps up to JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization import online, weights

LAYERS, K, N = 8, 512, 1024


def test_int4_layers_do_not_hold_every_dequantized_weight_at_once():
    ws = [online.quantize_int4(jax.random.normal(jax.random.key(i), (K, N), jnp.bfloat16) * 0.02, 128,
                               jnp.bfloat16) for i in range(LAYERS)]

    def forward(x, ws):
        for w in ws:                                     # unrolled layers, as the decoder runs them
            x = jnp.tanh(weights.matmul(x, w)[:, :K])
        return x

    x = jax.ShapeDtypeStruct((64, K), jnp.bfloat16)
    temp = jax.jit(forward).lower(x, ws).compile().memory_analysis().temp_size_in_bytes
    one_copy = K * N * 2                                 # one layer's weight in bf16
    assert temp < 3 * one_copy, f"temporaries {temp / 2**20:.1f} MiB: {temp / one_copy:.1f} dequantized layers live"


def test_fp8_weight_only_decode_is_the_dequantized_product_and_w8a8_stays_above_the_bound(monkeypatch):
    w = jax.random.normal(jax.random.key(0), (K, N), jnp.float32) * 0.02
    q8 = online.quantize_fp8_per_channel(w)
    dequant = (q8.weight.astype(jnp.float32).reshape(N, K) * q8.scale.reshape(N, 1)).T
    x = jax.random.normal(jax.random.key(1), (4, K), jnp.bfloat16)
    exact = np.asarray(x.astype(jnp.float32) @ dequant)
    monkeypatch.setenv("JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS", "4")
    w8a16 = np.asarray(weights.matmul(x, q8).astype(jnp.float32))
    w8a8 = np.asarray(weights.matmul(jnp.concatenate([x, x]), q8).astype(jnp.float32))[:4]   # 8 rows > 4
    np.testing.assert_allclose(w8a16, exact, rtol=2e-2, atol=2e-3)
    assert np.abs(w8a16 - exact).max() < np.abs(w8a8 - exact).max()   # the activations kept their bf16 bits


def test_rms_norm_fp8_is_the_norm_quantized_per_token_within_e4m3():
    from jaxserve.models.layers.norms import rms_norm
    x = jax.random.normal(jax.random.key(2), (5, K), jnp.bfloat16) * 3
    w = (1 + 0.3 * jax.random.normal(jax.random.key(3), (K,))).astype(jnp.bfloat16)
    a = weights.rms_norm_fp8(x, w, 1e-5)
    h = np.asarray(rms_norm(x, w, 1e-5), np.float32)
    q = np.asarray(a.q, np.float32)
    # the row maximum lands just under e4m3's 448 (the scale's margin covers the norm's bf16 roundings)
    assert np.all(np.abs(q).max(1) <= 448) and np.all(np.abs(q).max(1) >= 448 / (1 + 2 ** -6) * (1 - 2 ** -7))
    np.testing.assert_allclose(q * np.asarray(a.scale), h, rtol=2 ** -3, atol=np.abs(h).max() * 2 ** -9)
    assert a.dtype == jnp.bfloat16


def test_fp8_projections_read_one_quantized_norm_output(monkeypatch):
    """q, k and v (or gate_up) take the norm's quantized output; W8A16 steps, block-scaled or static-scale
    weights and float weights take the norm's bf16 output."""
    w = online.quantize_fp8_per_channel(jax.random.normal(jax.random.key(0), (K, N), jnp.float32) * 0.02)
    assert weights.reads_fp8_activations((w, w, w), 4)
    assert not weights.reads_fp8_activations((w, jnp.zeros((K, N))), 4)
    assert not weights.reads_fp8_activations((), 4)
    monkeypatch.setenv("JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS", "4")
    assert not weights.reads_fp8_activations((w,), 4) and weights.reads_fp8_activations((w,), 5)
    x = jax.random.normal(jax.random.key(1), (8, K), jnp.bfloat16)
    ones = jnp.ones((K,), jnp.bfloat16)
    from jaxserve.models.layers.norms import rms_norm
    h = rms_norm(x, ones, 1e-5)
    dequant = (w.weight.astype(jnp.float32).reshape(N, K) * w.scale.reshape(N, 1)).T
    exact = np.asarray(h.astype(jnp.float32) @ dequant)

    def rms_error(y):
        return float(np.sqrt(np.mean((np.asarray(y, np.float32) - exact) ** 2)))

    fused, separate = weights.matmul(weights.rms_norm_fp8(x, ones, 1e-5), w), weights.matmul(h, w)
    # the same e4m3 rounding of the activations, from a scale up to 2^-6 larger: errors of one size
    assert rms_error(fused) < 1.25 * rms_error(separate) < 0.05 * np.abs(exact).max()
