"""Golden fixtures of the DeepSeek family (tests/models/test_deepseek_models.py), made the way
tests/make_model_fixtures.py makes the others (``make_tiny``: random bf16-exact weights, HF reading the saved
folder in float32, a greedy path without near-ties).

- tiny-deepseek-v2: q LoRA, group-limited greedy routing (4 groups, 2 kept), a dense first layer, scaled routed
  weights, one shared expert.
- tiny-deepseek-v2-lite: no q LoRA, YaRN with mscale != mscale_all_dim (both the rotary's attention factor and
  the softmax scale bite), greedy routing.
- tiny-deepseek-v3: sigmoid scores plus a random e_score_correction_bias, node-limited top-k (4 groups, 2 kept),
  renormalised and scaled weights, interleaved RoPE; the checkpoint also carries one multi-token-prediction
  layer's tensors (``model.layers.3.*``, ``num_nextn_predict_layers: 1``), which HF and jaxserve do not read.

Run with the oracle env:  .venv-oracle/bin/python tests/make_deepseek_fixtures.py [name ...]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

import make_model_fixtures  # noqa: E402
from make_model_fixtures import COMMON, OUT, make_tiny  # noqa: E402

BASE = {**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "moe_intermediate_size": 16, "n_shared_experts": 1}

TINY_DEEPSEEK = {
    "tiny-deepseek-v2": (DeepseekV2ForCausalLM, DeepseekV2Config(
        **BASE, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})),
    "tiny-deepseek-v2-lite": (DeepseekV2ForCausalLM, DeepseekV2Config(
        **BASE, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
                         "beta_fast": 32, "beta_slow": 1})),
    "tiny-deepseek-v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **BASE, q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
MTP = {"tiny-deepseek-v3": 1}


def randomize_with_bias(model: torch.nn.Module, seed: int) -> None:
    """``make_model_fixtures.randomize``, and V3's router bias (a buffer) random too (HF inits it to zeros)."""
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((0.1 * torch.randn(buf.shape, generator=g)).to(torch.bfloat16).float())


def add_mtp_layers(name: str, count: int) -> None:
    """Tensors of ``count`` multi-token-prediction layers after the last layer, as the released V3 has them."""
    folder = os.path.join(OUT, name)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    for i in range(layers, layers + count):
        tensors[f"model.layers.{i}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden, dtype=torch.bfloat16)
        tensors[f"model.layers.{i}.enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = count
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


randomize = make_model_fixtures.randomize

if __name__ == "__main__":
    torch.set_num_threads(2)
    make_model_fixtures.randomize = randomize_with_bias
    for name in sys.argv[1:] or list(TINY_DEEPSEEK):
        make_tiny(name, *TINY_DEEPSEEK[name])
        if name in MTP:
            add_mtp_layers(name, MTP[name])
