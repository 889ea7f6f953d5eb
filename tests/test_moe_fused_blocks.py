"""``JAXSERVE_MOE_FUSED_BLOCKS``: the fused MoE decode kernels' blocks for a whole engine. The value reaches the
kernel call, a malformed one stops the model's build naming the variable and the key, two values are two
program-cache keys, and a non-default setting still gives HF's logits and greedy ids on the tiny Qwen3-MoE."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.kernels import fused_moe
from jaxserve.models.layers import moe
from jaxserve.models.loader import load_model
from jaxserve.runner import program_cache
from tiny_models import FIXTURES, check_greedy_matches_hf, check_logits_match_hf, golden, hf_logits

VAR = "JAXSERVE_MOE_FUSED_BLOCKS"
CFG = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=8, hidden_size=64, intermediate_size=8,
                  num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, model_type="qwen3_moe",
                  extra=(("moe_intermediate_size", 32), ("num_experts", 8), ("num_experts_per_tok", 2)))


def _spec(monkeypatch, blocks: str | None) -> moe.MoESpec:
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", "fused")
    if blocks is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, blocks)
    return moe.moe_spec(CFG, renormalize=True, weights_in_hidden_dtype=False)


def _record_fused_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every ``fused_moe.fused_moe`` call the MoE layers make (the kernels still run)."""
    calls, real = [], fused_moe.fused_moe

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(fused_moe, "fused_moe", spy)
    return calls


def test_parse_blocks_reads_every_key_in_the_kernels_order():
    assert fused_moe.parse_blocks("bi=32,bh=64,s=4,bk=128,dk=128,w=4,st=3") == {
        "block_i": 32, "block_h": 64, "splits": 4, "block_k": 128, "down_block_k": 128, "num_stages": 3,
        "num_warps": 4}
    assert list(fused_moe.parse_blocks("w=8, bi=16")) == ["block_i", "num_warps"]


def test_the_variable_reaches_the_kernel_call(monkeypatch):
    """Unset: no block arguments (``GPU_BLOCKS``); set: its blocks in the spec (one spec for both spellings)
    and in the kernel call of a decode-sized MoE step."""
    assert _spec(monkeypatch, None).fused_blocks == ()
    spec = _spec(monkeypatch, "w=8,bi=16,bh=32")
    assert spec.fused_blocks == (("block_i", 16), ("block_h", 32), ("num_warps", 8))
    assert _spec(monkeypatch, "bi=16,bh=32,w=8") == spec
    calls = _record_fused_calls(monkeypatch)
    rng = np.random.default_rng(0)
    w = {"router": jnp.asarray(rng.standard_normal((64, 8)), jnp.float32),
         "experts_gate_up": jnp.asarray(rng.standard_normal((8, 64, 2, 32)) * 0.2, jnp.float32),
         "experts_down": jnp.asarray(rng.standard_normal((8, 32, 64)) * 0.2, jnp.float32)}
    out, _ = moe.moe_mlp(jnp.asarray(rng.standard_normal((4, 64)), jnp.float32), w, spec, jax.nn.silu)
    assert calls == [{"block_i": 16, "block_h": 32, "num_warps": 8}]
    assert np.isfinite(np.asarray(out)).all()
    assert fused_moe.resolve_blocks(64, 32, interpret=True, **calls[0]) == {
        "block_i": 16, "block_h": 32, "splits": 1, "block_k": 64, "down_block_k": 32, "num_stages": 3,
        "num_warps": 8}


@pytest.mark.parametrize("value, why", [
    ("bi=32,q=3", "unknown key q"), ("bi=32,bi=16", "key bi given twice"), ("bi=0", "bi='0'"),
    ("bh=big", "bh='big'"), ("w=3", "w=3: Triton's warps"), ("bi=32,", "an empty part"),
    ("32", "'32' is not key=value"),
])
def test_a_malformed_value_is_refused_naming_the_variable_and_key(monkeypatch, value, why):
    with pytest.raises(ValueError, match="^" + re.escape(f"{VAR}={value!r}: ")) as e:
        _spec(monkeypatch, value)
    assert why in str(e.value)


def test_a_malformed_value_stops_the_model_load(monkeypatch):
    """At the engine's start (the model's build makes its spec), not at a trace deep in a kernel."""
    monkeypatch.setenv(VAR, "bi=32,block_q=8")
    from jaxserve.models import qwen3_moe
    qwen3_moe.FAMILY.clear_caches()      # specs are cached per config: forget the other runs'
    try:
        with pytest.raises(ValueError, match=f"{VAR}='bi=32,block_q=8': unknown key block_q"):
            load_model(os.path.join(FIXTURES, "tiny-qwen3moe"), dtype="float32")
    finally:
        qwen3_moe.FAMILY.clear_caches()


def test_two_values_are_two_program_cache_keys(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    unset = program_cache._environment()
    monkeypatch.setenv(VAR, "bi=16,w=8")
    first = program_cache._environment()
    monkeypatch.setenv(VAR, "bi=64")
    second = program_cache._environment()
    assert len({unset, first, second}) == 3


def test_non_default_blocks_match_hf_on_the_tiny_moe(monkeypatch):
    """Smaller column blocks and loop steps than the interpreter's one block per expert (several programs and
    k-steps each), through the model: HF's logits, and its greedy ids decoded twice in one batch."""
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", "fused")
    monkeypatch.setenv(VAR, "bh=16,bk=16,dk=16,w=8,st=2")
    from jaxserve.models import qwen3_moe
    qwen3_moe.FAMILY.clear_caches()
    model = load_model(os.path.join(FIXTURES, "tiny-qwen3moe"), dtype="float32")
    calls = _record_fused_calls(monkeypatch)
    try:
        spec = model.family.decoder_spec(model.config).moe
        assert spec.decode_kernel == "fused" and spec.rows_path_max_tokens == 16
        assert dict(spec.fused_blocks) == {"block_h": 16, "block_k": 16, "down_block_k": 16, "num_stages": 2,
                                           "num_warps": 8}
        check_logits_match_hf("tiny-qwen3moe", model, golden("tiny-qwen3moe"), hf_logits("tiny-qwen3moe"))
        check_greedy_matches_hf("tiny-qwen3moe", model, golden("tiny-qwen3moe"))
    finally:
        model.family.clear_caches()
    assert calls and all(c == dict(spec.fused_blocks) for c in calls)


def test_a_benchmark_result_records_the_blocks_it_ran(monkeypatch):
    from benchmarks import envinfo

    monkeypatch.setenv(VAR, "bi=16,w=8")
    monkeypatch.setenv("JAXSERVE_API_KEY", "secret")
    env = envinfo.environment([], with_devices=False)["env"]
    assert env[VAR] == "bi=16,w=8" and "JAXSERVE_API_KEY" not in env
