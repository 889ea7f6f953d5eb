"""Golden fixtures of the mixture-of-experts families (tests/test_moe_models.py), made the way
tests/make_model_fixtures.py makes the dense ones (its ``make_tiny``: random bf16-exact weights, HF reading the
saved folder in float32, a greedy path without near-ties).

Run with the oracle env:  .venv-oracle/bin/python tests/make_moe_fixtures.py [name ...]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,  # noqa: E402
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from make_model_fixtures import COMMON, make_tiny  # noqa: E402

# experts small enough to keep each folder small, enough of them that tensor/expert parallelism over 2 and 4
# fake devices splits them (8 / 16 experts, 16 or 32 intermediate columns each; Mixtral's 32 and RoPE base
# 1e4 keep its greedy path from settling on one repeated token, which would test little of decoding)
TINY_MOE = {
    "tiny-mixtral": (MixtralForCausalLM, MixtralConfig(
        **{**COMMON, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e4)),
    # top-4 of 8 without renormalisation, a shared expert, and layer 1 a dense MLP (mlp_only_layers)
    "tiny-qwen2moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1e6)),
    # top-4 of 16, renormalised, q/k norm attention
    "tiny-qwen3moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **COMMON, head_dim=16, moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, rope_theta=1e6)),
}

if __name__ == "__main__":
    torch.set_num_threads(2)
    for name in sys.argv[1:] or list(TINY_MOE):
        make_tiny(name, *TINY_MOE[name])
