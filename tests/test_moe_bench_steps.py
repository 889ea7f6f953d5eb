"""The MoE measurements before they meet a GPU: moe_gemm's ``fused[...]`` row names and the fused kernels' block
rounding its tuning search relies on, and a non-default block setting still computing the layer."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.diagnostics import moe_gemm
from jaxserve.kernels import fused_moe


@pytest.mark.parametrize("name, blocks", [
    ("fused[32,128,8]", {"block_i": 32, "block_h": 128, "splits": 8}),
    ("fused[32,64,4,256,3]", {"block_i": 32, "block_h": 64, "splits": 4, "block_k": 256, "num_stages": 3}),
    ("fused[dk=128,w=8]", {"down_block_k": 128, "num_warps": 8}),
    ("fused[bi=16,bh=32,s=2,bk=64,dk=32,st=2,w=8]", {"block_i": 16, "block_h": 32, "splits": 2, "block_k": 64,
                                                     "down_block_k": 32, "num_stages": 2, "num_warps": 8}),
])
def test_fused_row_names_give_the_kernel_arguments(name, blocks):
    assert moe_gemm.fused_blocks(name) == blocks


@pytest.mark.parametrize("name, why", [
    ("fused[32,64]", "3 to 5 positional"), ("fused[1,2,3,4,5,6]", "3 to 5 positional"),
    ("fused[bi=32,64,4]", "not both"), ("fused[x=1]", "unknown key x"), ("fused[bi=1,bi=2]", "given twice"),
    ("fused[bi=0]", "positive integer"), ("fused[bi=a]", "positive integer"), ("fused[]", "expected"),
    ("fused[32,,4]", "expected"), ("layer:fused", "expected"),
])
def test_fused_row_names_that_are_not_say_why(name, why):
    with pytest.raises(ValueError, match=why):
        moe_gemm.fused_blocks(name)


def test_fused_name_spells_out_every_block_and_reads_back():
    blocks = fused_moe.resolve_blocks(2048, 768)
    name = moe_gemm.fused_name(blocks)
    assert name == "fused[bi=32,bh=64,s=4,bk=128,dk=64,st=3,w=4]"      # GPU_BLOCKS at Qwen3-30B-A3B's widths
    assert moe_gemm.fused_blocks(name) == blocks


def test_impls_and_tune_refuse_what_they_cannot_time():
    with pytest.raises(SystemExit):
        moe_gemm.main(["--smoke", "--decode", "--impls", "layer:fused,fused[bi=16,q=3]"])
    with pytest.raises(SystemExit):
        moe_gemm.main(["--smoke", "--tune", "--tokens", "32"])         # the decode kernels stop at 16 tokens


def test_resolve_blocks_rounds_each_block_to_its_dimension():
    """Settings that resolve alike are the same kernels (the tuning search times them once)."""
    qwen, mixtral = fused_moe.resolve_blocks(2048, 768), fused_moe.resolve_blocks(4096, 14336)
    assert qwen == mixtral == fused_moe.GPU_BLOCKS
    # 768 / 4 = 192 rows a split: down's step rounds to 64; one split of 768 takes 256
    assert fused_moe.resolve_blocks(2048, 768, down_block_k=128)["down_block_k"] == 64
    assert fused_moe.resolve_blocks(2048, 768, splits=1, down_block_k=512)["down_block_k"] == 256
    assert fused_moe.resolve_blocks(2048, 768, block_i=512)["block_i"] == 256           # 768 = 3 x 256
    tiny = fused_moe.resolve_blocks(64, 32, splits=4, block_h=256)
    assert (tiny["splits"], tiny["block_h"], tiny["down_block_k"]) == (2, 64, 16)       # 32 / 4 = 8 rows: halved
    interpreted = fused_moe.resolve_blocks(64, 32, interpret=True)
    assert (interpreted["block_i"], interpreted["block_h"], interpreted["splits"]) == (32, 64, 1)
    assert fused_moe.resolve_blocks(2048, 768, num_warps=8, num_stages=2) == fused_moe.GPU_BLOCKS | {
        "num_warps": 8, "num_stages": 2}
    with pytest.raises(TypeError, match="unknown block_q"):
        fused_moe.resolve_blocks(2048, 768, block_q=16)


def test_fused_moe_at_other_loop_steps_matches_reference():
    """Down's rows per loop step (the knob the tuning search adds) and gate/up's, several steps per split:
    the same layer as the reference (interpreted)."""
    t, e, k, hidden, inter = 4, 8, 2, 64, 64
    rng = np.random.default_rng(7)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32))
    h = jnp.asarray(rng.standard_normal((t, hidden)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, hidden, 2, inter)) * 0.2, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, inter, hidden)) * 0.2, jnp.float32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    want = np.asarray(fused_moe.fused_moe_reference(h, ids, weights, gate_up, down, jax.nn.silu))
    got = np.asarray(fused_moe.fused_moe(h, ids, weights, gate_up, down, jax.nn.silu, block_i=32, block_h=32,
                                         splits=2, block_k=16, down_block_k=16))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
