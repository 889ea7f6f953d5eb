"""benchmarks/gemv_probe.gemv (interpret mode on CPU) against ``x @ w`` in f32, and its GPU build's lowering.

Tiny shapes with several column blocks and K steps per program; M = 1 and 5 (rows past M are masked in the
kernel's 16-row tile), split_k 1 and 2. Error: max |out - ref| / max |ref|.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.gemv_probe import gemv

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_matches_matmul(m, split_k, dtype):
    kx, kw = jax.random.split(jax.random.key(m * 10 + split_k))
    x = jax.random.normal(kx, (m, 128), dtype)
    w = jax.random.normal(kw, (128, 96), dtype)
    out = gemv(x, w, block_n=32, block_k=32, split_k=split_k, num_warps=4, num_stages=3, interpret=True)
    ref = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
    assert out.shape == (m, 96) and out.dtype == dtype
    out = np.asarray(out, np.float32)
    assert float(np.abs(out - ref).max() / np.abs(ref).max()) <= TOL[dtype]


def test_gemv_rejects_shapes_that_do_not_divide():
    x, w = jnp.zeros((1, 96), jnp.float32), jnp.zeros((96, 64), jnp.float32)
    with pytest.raises(AssertionError):
        gemv(x, w, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=3, interpret=True)


@pytest.mark.parametrize("m,split_k", [(1, 1), (16, 4)])
def test_gemv_lowers_for_cuda(m, split_k):
    """The Triton build lowers for an (abstract) H200 here on CPU, catching primitives the Triton lowering
    lacks; Triton's own compile (shared memory, layouts) still needs a GPU."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 3072), jnp.bfloat16)
    fn = jax.jit(functools.partial(gemv, block_n=128, block_k=256, split_k=split_k, num_warps=4, num_stages=3))
    with jax.sharding.use_abstract_mesh(mesh):
        text = fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
