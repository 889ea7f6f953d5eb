"""The fp8 W8A8 decode step's program (random fp8 weights, as ``--load-format dummy --quantization fp8`` makes
them): each projection is one fp8 x fp8 dot over the weight as stored, ``[N, K]`` with K contracted on both
operands (the "TN" layout cuBLASLt's fp8 GEMM takes as is), and nothing else reads an fp8 weight (gate_up's
reshape aside, which is free): no per-step transpose, copy or upcast of a weight. The activations are quantized
once per norm (``rms_norm_fp8``) or, with ``JAXSERVE_FP8_NORM_QUANT=0``, before each projection."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve import envs
from jaxserve.config import ModelConfig
from jaxserve.kernels import ops
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.models import llama
from jaxserve.models.dummy_loader import dummy_params
from jaxserve.quantization.config import checkpoint_quantization

LAYERS = 2
PROJECTIONS = ("q", "k", "v", "o", "gate_up", "down")


@pytest.fixture(params=["1", "0"], ids=["norm-quant", "per-projection-quant"])
def decode_program(request, monkeypatch) -> str:
    """The lowered StableHLO of a 4-token decode step of a two-layer Llama with fp8 weights (under each setting
    of ``JAXSERVE_FP8_NORM_QUANT``, which stays set for the test)."""
    monkeypatch.setenv("JAXSERVE_FP8_NORM_QUANT", request.param)
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=LAYERS,
                      num_heads=4, num_kv_heads=2, head_dim=64)
    family = llama.FAMILY
    params = jax.eval_shape(lambda: dummy_params(cfg, family, jnp.bfloat16, 0, None, checkpoint_quantization("fp8")))
    caches = ops.init_kv_caches(LAYERS, 4, 16, 2, 64, jnp.bfloat16)
    md = AttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32), block_tables=jnp.zeros((4, 4), jnp.int32),
                           seq_lens=jnp.ones(4, jnp.int32), query_start_loc=jnp.arange(5, dtype=jnp.int32),
                           num_seqs=jnp.int32(4), decode_only=True)
    step = jax.jit(lambda p, kv, ids: family.forward(p, kv, ids, ids, md, cfg))
    return step.lower(params, caches, jnp.zeros(4, jnp.int32)).as_text()


def _fp8_weight_values(text: str) -> set[str]:
    """The SSA names of the step's fp8 weight arguments and of their reshapes."""
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    names = set(re.findall(r"(%arg\d+): tensor<[0-9x]+xf8E4M3FN>", main))
    for value, source in re.findall(r"(%\w+) = stablehlo\.reshape (%\w+) ", text):
        if source in names:
            names.add(value)
    return names


def test_every_fp8_weight_is_read_only_by_fp8_dots_contracting_its_minor_dim(decode_program):
    weights = _fp8_weight_values(decode_program)
    assert len([w for w in weights if w.startswith("%arg")]) == LAYERS * len(PROJECTIONS)
    dots = 0
    for line in decode_program.splitlines():
        used = [w for w in weights if re.search(re.escape(w) + r"\b", line.split("=", 1)[-1])]
        if not used or "func.func" in line:
            continue
        op = re.search(r"(?:stablehlo|mhlo)\.(\w+)", line).group(1)
        if op == "reshape":
            continue
        assert op == "dot_general", f"an fp8 weight feeds {op}: {line.strip()}"
        dots += 1
        lhs, rhs = re.search(r"stablehlo\.dot_general (%[\w#]+), (%[\w#]+),", line).groups()
        assert rhs in weights and lhs not in weights, line.strip()
        assert "contracting_dims = [1] x [1]" in line and "batching_dims" not in line, line.strip()
        operands = re.search(r": \((tensor<[^>]+>), (tensor<[^>]+>)\)", line).groups()
        assert all(t.endswith("xf8E4M3FN>") for t in operands), f"not an fp8 x fp8 dot: {line.strip()}"
    assert dots == LAYERS * len(PROJECTIONS)


def test_activations_are_quantized_once_per_norm_or_per_projection(decode_program):
    casts = len(re.findall(r"stablehlo\.convert %\w+ : \(tensor<[0-9x]+xf32>\) -> tensor<[0-9x]+xf8E4M3FN>",
                           decode_program))
    # per layer: the attention norm (q, k, v) and the MLP norm (gate_up) once each, o's and down's inputs
    per_layer = 4 if envs.JAXSERVE_FP8_NORM_QUANT else len(PROJECTIONS)
    assert casts == LAYERS * per_layer
