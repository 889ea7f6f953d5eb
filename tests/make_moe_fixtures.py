"""Golden fixtures of the mixture-of-experts families (tests/models/test_moe_models.py), made the way
tests/make_model_fixtures.py makes the dense ones (its ``make_tiny``: random bf16-exact weights, HF reading the
saved folder in float32, a greedy path without near-ties).

Each folder also gets ``expert_load.json``: HF's own routing (its router logits, softmax, top-k) of the
prompt and its greedy continuation counted per MoE layer and expert — the tokens an engine run of that
sequence routes to each expert (``--expert-load-only`` rewrites just these from the committed weights).

Run with the oracle env:  .venv-oracle/bin/python tests/make_moe_fixtures.py [--expert-load-only] [name ...]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,  # noqa: E402
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from make_model_fixtures import COMMON, OUT, make_tiny  # noqa: E402

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



def make_expert_load(name: str, cls) -> None:
    """Per MoE layer, the tokens HF routes to each expert over the prompt and the greedy continuation's
    first 31 tokens (the ones a 32-token generation feeds back), and the smallest gap between a token's k-th
    and (k+1)-th routing probability (a near-tie would make the count fragile)."""
    folder = os.path.join(OUT, name)
    with open(os.path.join(folder, "golden.json")) as f:
        golden = json.load(f)
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = golden["prompt_ids"] + golden["greedy_ids"][:-1]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    cfg, counts, margin = model.config, [], 1.0
    experts, k = cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts, cfg.num_experts_per_tok
    for logits in out.router_logits:
        probs = torch.softmax(logits.reshape(len(ids), experts).float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        margin = min(margin, float((top[:, k - 1] - top[:, k]).min()))
        chosen = torch.topk(probs, k, dim=-1).indices.reshape(-1)
        counts.append(torch.bincount(chosen, minlength=experts).tolist())
    with open(os.path.join(folder, "expert_load.json"), "w") as f:
        json.dump({"num_tokens": len(ids), "tokens_per_expert": counts, "min_margin": margin}, f, indent=1)
    print(f"{name}: expert load over {len(ids)} tokens, min routing margin {margin:.2e}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    args = sys.argv[1:]
    load_only = "--expert-load-only" in args
    for name in [a for a in args if not a.startswith("--")] or list(TINY_MOE):
        if not load_only:
            make_tiny(name, *TINY_MOE[name])
        make_expert_load(name, TINY_MOE[name][0])
