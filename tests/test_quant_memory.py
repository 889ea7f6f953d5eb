"""A step dequantizes one layer's int4 weights at a time: XLA must not hoist every layer's bf16 copy to the
start of the forward (an 8B int4 engine ran out of memory on an H200 that way)."""
import jax
import jax.numpy as jnp

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
