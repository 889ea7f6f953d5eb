"""Which kernel a GPU runs a quantized product with. int4 (``weights.int4_step_kernel``): by default the CUDA
FFI GEMV for bf16 steps of up to 16 tokens; with ``JAXSERVE_INT4_FFI_GEMV=0`` or where the GEMV cannot run (no
nvcc: one log line) the Pallas kernel; XLA's GEMM above 16 tokens. fp8 (``weights.fp8_step_uses_gemv``):
the CUDA GEMV, weight-only, for bf16 steps of up to 16 tokens (the norm then does not quantize the activations
for it); with ``JAXSERVE_FP8_FFI_GEMV=0`` W8A8. CPU keeps the jnp reference."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import cuda_build, quant_gemv
from jaxserve.quantization import online, weights


@pytest.fixture
def ready(monkeypatch):
    """The GEMV as if built and registered (``weights.quant_gemv_ready`` is cached per process), the switch unset."""
    weights.quant_gemv_ready.cache_clear()
    monkeypatch.delenv("JAXSERVE_INT4_FFI_GEMV", raising=False)
    monkeypatch.setattr(quant_gemv, "load", lambda toolchain: object())
    yield
    weights.quant_gemv_ready.cache_clear()


@pytest.mark.parametrize("m", [1, 4, 16])
def test_bf16_decode_steps_take_the_ffi_gemv(ready, m):
    assert weights.int4_step_kernel(m, 4096, 6144, 128, jnp.bfloat16) == "ffi"


def test_the_other_steps_keep_their_kernels(ready):
    assert weights.int4_step_kernel(17, 4096, 4096, 128, jnp.bfloat16) is None        # XLA's GEMM
    assert weights.int4_step_kernel(4, 4096, 4096, 128, jnp.float32) == "pallas"       # the GEMV is bf16 only
    assert weights.int4_step_kernel(4, 4096, 4100, 128, jnp.bfloat16) is None          # neither takes N % 8 != 0


@pytest.mark.parametrize("value", ["0", ""])
def test_the_switch_off_keeps_the_pallas_kernel(ready, monkeypatch, value):
    monkeypatch.setenv("JAXSERVE_INT4_FFI_GEMV", value)
    assert weights.int4_step_kernel(1, 4096, 4096, 128, jnp.bfloat16) == "pallas"


def test_no_nvcc_falls_back_to_pallas_with_one_log_line(monkeypatch, caplog, tmp_path):
    weights.quant_gemv_ready.cache_clear()
    monkeypatch.setattr(cuda_build.Toolchain, "find_nvcc", lambda self: None)
    monkeypatch.setattr(quant_gemv, "_lib", None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")      # load() gets as far as the build
    monkeypatch.setattr(jax, "local_devices", lambda: [object()])
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("JAXSERVE_INT4_FFI_GEMV", "1")
    try:
        with caplog.at_level(logging.WARNING, logger=weights.__name__):
            kinds = [weights.int4_step_kernel(1, 4096, 4096, 128, jnp.bfloat16) for _ in range(3)]
    finally:
        weights.quant_gemv_ready.cache_clear()
    assert kinds == ["pallas"] * 3
    lines = [r.getMessage() for r in caplog.records if "CUDA GEMV is unavailable" in r.getMessage()]
    assert len(lines) == 1 and "no nvcc found" in lines[0]


def test_cpu_keeps_the_reference(ready):
    w = online.quantize_int4(jax.random.normal(jax.random.key(0), (256, 64), jnp.float32) * 0.02, 64,
                             jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 256), jnp.bfloat16)
    hlo = jax.jit(weights.matmul).lower(x, w).as_text()
    assert quant_gemv.TARGET_INT4 not in hlo
    want = weights.int4_kernel.int4_matmul_reference(x, w.packed, w.scales, w.zeros, 64)
    np.testing.assert_array_equal(np.asarray(weights.matmul(x, w), np.float32), np.asarray(want, np.float32))


def test_fp8_takes_the_gemv_unless_switched_off(ready, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w8 = online.quantize_fp8_per_channel(jax.random.normal(jax.random.key(0), (256, 64), jnp.float32))
    monkeypatch.setenv("JAXSERVE_FP8_FFI_GEMV", "0")
    assert not weights.fp8_step_uses_gemv(4)
    assert weights.reads_fp8_activations([w8], 4)                    # W8A8
    monkeypatch.delenv("JAXSERVE_FP8_FFI_GEMV")
    assert weights.fp8_step_uses_gemv(1) and weights.fp8_step_uses_gemv(16)
    assert not weights.fp8_step_uses_gemv(17)
    assert not weights.reads_fp8_activations([w8], 4)                # weight-only: bf16 activations
    assert weights.reads_fp8_activations([w8], 64)


def test_fp8_switch_does_nothing_on_cpu(ready, monkeypatch):
    monkeypatch.setenv("JAXSERVE_FP8_FFI_GEMV", "1")
    assert not weights.fp8_step_uses_gemv(4)


def test_larger_steps_take_the_gemv_16_rows_a_call_when_asked(ready, monkeypatch):
    assert weights.int4_step_kernel(40, 4096, 4096, 128, jnp.bfloat16) is None         # default: XLA's GEMM
    monkeypatch.setenv("JAXSERVE_INT4_GEMV_MAX_TOKENS", "64")
    assert weights.int4_step_kernel(40, 4096, 4096, 128, jnp.bfloat16) == "ffi"
    assert weights.int4_step_kernel(64, 4096, 4096, 128, jnp.bfloat16) == "ffi"
    assert weights.int4_step_kernel(65, 4096, 4096, 128, jnp.bfloat16) is None
    assert weights.int4_step_kernel(40, 4096, 4096, 128, jnp.float32) is None           # not the Pallas kernel
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    from jaxserve.kernels import device_info
    monkeypatch.setattr(device_info, "num_sms", lambda: 132)
    w = online.quantize_int4(jax.random.normal(jax.random.key(0), (256, 64), jnp.float32) * 0.02, 64,
                             jnp.bfloat16)
    x = jnp.zeros((40, 256), jnp.bfloat16)
    hlo = jax.jit(weights.matmul).lower(x, w).as_text()
    calls = [line for line in hlo.splitlines() if quant_gemv.TARGET_INT4 in line and "custom_call" in line]
    assert len(calls) == 3, calls                     # rows 0-15, 16-31, 32-39


def test_a_float_model_never_builds_the_gemv(monkeypatch):
    """The norm asks whether its projections read fp8 activations on every step of every model: for weights
    that are not fp8 the answer must not start the GEMV's build (nvcc) on a GPU host."""
    weights.quant_gemv_ready.cache_clear()
    asked = []
    monkeypatch.setattr(weights, "quant_gemv_ready", lambda: asked.append(1) or True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not weights.reads_fp8_activations((jnp.zeros((64, 64)), jnp.zeros((64, 64))), 4)
    assert not weights.reads_fp8_activations((), 4)
    assert asked == []
