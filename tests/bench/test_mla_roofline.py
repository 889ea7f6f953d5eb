"""The roofline of multi-head latent attention and DeepSeekMoE (benchmarks/roofline.py), against counts
worked out by hand from the public configs (configs/models/deepseek-v2-lite.json, deepseek-v3-6l.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.benchmarks import roofline
from jaxserve.models.configs import model_config_from_hf

ROOT = Path(__file__).resolve().parents[2]
H200 = roofline.load_hardware("h200")[0]


def _config(name: str):
    return model_config_from_hf(json.loads((ROOT / "configs" / "models" / f"{name}.json").read_text()))


def test_deepseek_v2_lite_counts():
    c = roofline.model_cost(_config("deepseek-v2-lite"))
    hidden, heads, layers, vocab = 2048, 16, 27, 102400
    r, p, nope, v = 512, 64, 128, 128
    # per layer: q (no q LoRA), kv_a (latent + rotary key), kv_a_norm, kv_b, o, two norms
    attn = hidden * heads * (nope + p) + hidden * (r + p) + r + r * heads * (nope + v) + heads * v * hidden \
        + 2 * hidden
    dense_mlp = 3 * hidden * 10944                                   # first_k_dense_replace = 1
    expert, routed, top_k = 3 * hidden * 1408, 64, 6
    shared, router = 2 * expert, hidden * routed                     # two shared experts, ungated
    moe_layers = layers - 1
    embed = vocab * hidden
    params = 2 * embed + hidden + layers * attn + dense_mlp + moe_layers * (router + shared + routed * expert)
    active = params - moe_layers * (routed - top_k) * expert
    assert c.params == params == 15_706_484_224                      # model card: 15.7 B
    assert c.active_params == active == 2_661_150_208                # 2.4 B activated, without the embedding
    assert (c.num_experts, c.experts_per_token) == (routed, top_k)
    assert c.expert_params == moe_layers * routed * expert
    assert c.weight_bytes == c.step_weight_bytes(1) == 2 * (active - embed)
    assert c.body_matmul_params == active - 2 * embed
    # the cache: one latent row of R + P values per token and layer, not K and V per head
    assert c.kv_bytes_per_token == layers * (r + p) * 2 == 31_104
    assert roofline.model_cost(_config("deepseek-v2-lite"), kv_dtype="fp8").kv_bytes_per_token == 15_552
    # absorbed attention: QK^T over R + P values and PV over R, per head, per key
    assert c.attn_flops_per_pair == layers * 2 * heads * (2 * r + p)
    assert c.decode_flops(4096) - c.decode_flops(0) == 4096 * layers * 2 * heads * (2 * r + p)
    assert c.decode_bytes(4096) == pytest.approx(2 * (active - embed) + 4096 * 31_104)
    assert c.prefill_bytes(128) == pytest.approx(c.step_weight_bytes(128) + 128 * 31_104)


def test_deepseek_v3_6l_counts():
    c = roofline.model_cost(_config("deepseek-v3-6l"))
    hidden, heads, layers, vocab = 7168, 128, 6, 129280
    q_rank, r, p, nope, v = 1536, 512, 64, 128, 128
    attn = hidden * q_rank + q_rank + q_rank * heads * (nope + p) + hidden * (r + p) + r \
        + r * heads * (nope + v) + heads * v * hidden + 2 * hidden
    dense_mlp = 3 * hidden * 18432                                   # first_k_dense_replace = 3
    expert, routed, top_k = 3 * hidden * 2048, 256, 8
    router = hidden * routed + routed                                # the weight and e_score_correction_bias
    embed = vocab * hidden
    params = 2 * embed + hidden + layers * attn + 3 * dense_mlp + 3 * (router + expert + routed * expert)
    active = params - 3 * (routed - top_k) * expert
    assert c.params == params == 38_125_674_240
    assert c.active_params == active == 5_359_771_392
    assert c.weight_bytes == 2 * (active - embed)                    # 8.87 GB a batch-1 step reads
    # the official FP8 checkpoints: the q LoRA, kv_a, o and dense MLP projections in fp8 (kv_b and the experts
    # are dequantized at load)
    fp8 = roofline.model_cost(_config("deepseek-v3-6l"), quantization="fp8")
    in_fp8 = layers * (hidden * q_rank + q_rank * heads * (nope + p) + hidden * (r + p) + heads * v * hidden) \
        + 3 * dense_mlp
    assert fp8.weight_bytes == c.weight_bytes - in_fp8
    assert c.kv_bytes_per_token == layers * 576 * 2 == 6_912
    assert c.attn_flops_per_pair == layers * 2 * heads * (2 * r + p)
    # batch 64 touches most of the 256 experts: 1 − (1 − 8/256)^64 of them
    touched = 1 - (1 - top_k / routed) ** 64
    assert c.step_weight_bytes(64) == pytest.approx(2 * (params - embed - 3 * routed * expert * (1 - touched)))
    t = roofline.decode_steps_bound(c, H200, batch=1, input_len=128, num_steps=1)
    assert t == pytest.approx((2 * (active - embed) + 129 * 6_912) / H200.bandwidth)


def test_cache_capacity_against_gqa():
    """Cache bytes per token and the tokens a budget holds: the roofline's count is the engine's block size
    (``runner.kv_cache.bytes_per_block``), and at 100 GiB the latent cache holds several times the tokens of
    GQA models of similar size."""
    import jax.numpy as jnp

    from jaxserve.runner import kv_cache
    for name in ("deepseek-v2-lite", "deepseek-v3-6l", "qwen3-30b-a3b", "llama-3.1-8b"):
        cfg = _config(name)
        for kv, dtype in (("bfloat16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
            per_token = roofline.model_cost(cfg, kv_dtype=kv).kv_bytes_per_token
            assert kv_cache.bytes_per_block(cfg, 16, dtype) == 16 * per_token
    c = roofline.model_cost(_config("deepseek-v2-lite"))
    assert c.tokens_held(100 * 2 ** 30) == 100 * 2 ** 30 // (16 * 31_104) * 16 == 3_452_096
    assert c.tokens_held(16 * 31_104 - 1) == 0 and c.tokens_held(16 * 31_104) == 16
    table = roofline.cache_capacity(["deepseek-v2-lite", "qwen3-30b-a3b", "llama-3.1-8b"], 100)
    rows = {r[0]: r for r in table.rows}
    assert rows["deepseek-v2-lite"][1:] == ["15.7 / 2.7", 27, 31_104, 3_452_096, 15_552, 6_904_192]
    assert rows["qwen3-30b-a3b"][3:] == [2 * 48 * 4 * 128 * 2, 1_092_256, 2 * 48 * 4 * 128, 2_184_528]
    assert rows["llama-3.1-8b"][3:5] == [131_072, 819_200]             # 100 GiB / 128 KiB
    assert "| deepseek-v2-lite | 15.7 / 2.7 | 27 | 31,104 | 3,452,096 |" in table.markdown()
