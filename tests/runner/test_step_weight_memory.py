"""The engine's forward step variants hold a weight in no other form than it is stored: the program XLA is given
reads each fp8 weight only in its fp8 x fp8 dots, and the compiled step's temp memory does not grow by a copy
of every layer's weights (a convert, dequantization or copy scheduled for all layers at once, which on an
8B model's largest bucket is tens of GiB). The variants are lowered as ``StepVariants`` lowers them, from
abstract weights and KV cache (``benchmarks/step_memory.py``, which runs the same at the 8B shape)."""
from __future__ import annotations

import re

import jax
import pytest

from jaxserve.benchmarks.step_memory import abstract_variants
from jaxserve.config import ModelConfig
from jaxserve.models import llama

BUCKETS = [4, 64]


def _variants(num_layers: int, quantization: str | None):
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=512,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=64)
    return abstract_variants(cfg, llama.FAMILY, quantization, BUCKETS, 64, "reference", max_model_len=256)


@pytest.mark.parametrize("bucket", BUCKETS, ids=["decode-bucket", "prefill-bucket"])
def test_fp8_step_reads_each_weight_only_in_its_dot(bucket):
    variants, _, _ = _variants(2, "fp8")
    text = variants.lower(("forward", bucket, False)).as_text()
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    weights = set(re.findall(r"(%arg\d+): tensor<[0-9x]+xf8E4M3FN>", main))
    assert len(weights) == 2 * 6                # q, k, v, o, gate_up, down per layer
    for value, source in re.findall(r"(%\w+) = stablehlo\.reshape (%\w+) ", text):
        if source in weights:
            weights.add(value)
    readers = []
    for line in text.splitlines():
        if "func.func" in line or "=" not in line:
            continue
        if any(re.search(re.escape(w) + r"\b", line.split("=", 1)[1]) for w in weights):
            readers.append(re.search(r"(?:stablehlo|mhlo)\.(\w+)", line).group(1))
    assert set(readers) == {"reshape", "dot_general"}, readers
    assert readers.count("dot_general") == 2 * 6


@pytest.mark.parametrize("quantization,per_weight", [(None, 0), ("awq", 0), ("fp8", 4)], ids=["bf16", "int4", "fp8"])
def test_step_temp_grows_by_no_copy_of_the_weights_per_layer(quantization, per_weight):
    """The compiled step's temp bytes per added layer: at most ``per_weight`` bytes per weight element (XLA:CPU
    has no fp8 dot and converts each fp8 weight to f32 at the start of the program, 4 bytes an element; a GPU
    dots fp8 as stored) plus an eighth of one layer's bf16 weights."""
    temps = {}
    for layers in (2, 4):
        variants, _, _ = _variants(layers, quantization)
        temps[layers] = [variants.lower(("forward", T, False)).compile().memory_analysis().temp_size_in_bytes
                         for T in BUCKETS]
    cfg = variants.cfg
    kv = cfg.num_kv_heads * cfg.head_dim
    layer_elements = cfg.hidden_size * (2 * cfg.hidden_size + 2 * kv + 3 * cfg.intermediate_size)
    bound = per_weight * layer_elements + 2 * layer_elements // 8
    for T, small, large in zip(BUCKETS, temps[2], temps[4]):
        assert (large - small) / 2 <= bound, (f"bucket {T}: temp grows {(large - small) / 2:.0f} bytes a layer "
                                              f"(bound {bound}): a copy of each layer's weights")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda pytest -m gpu)")
def test_fp8_decode_step_on_a_gpu_copies_no_weight():
    """Compiled by XLA's GPU pipeline at the 8B shape (two layers), the fp8 decode step dots each weight as
    stored: no q / k / v concatenation (XLA's dot merger made one every step before ``layers.linear.unmerged``)."""
    from jaxserve.benchmarks.step_memory import model_config, weight_copies
    cfg, family = model_config("llama-3.1-8b", 2)
    variants, _, _ = abstract_variants(cfg, family, "fp8", [4], 1024, "pallas")
    assert weight_copies(variants.lower(("forward", 4, True)).compile().as_text()) == []
