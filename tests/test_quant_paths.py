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
