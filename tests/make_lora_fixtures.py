"""LoRA fixtures from HF transformers + peft (the oracle) for tests/llm/test_lora.py and
tests/server/test_lora_server.py.

Run with the oracle env (torch + transformers + peft):  .venv-oracle/bin/python tests/make_lora_fixtures.py

The base is the tiny Llama 3 fixture (tests/fixtures/models/tiny-llama3, read in float32). Writes under
tests/fixtures/lora/:
- <adapter>/: a tiny random PEFT adapter (adapter_config.json + adapter_model.safetensors, float32); peft
  starts B at zero, so A and B are both drawn at random here, large enough that the greedy path moves away
  from the base model's.
- golden.json: prompts, and per adapter (and the base alone) HF + peft float32 greedy continuations.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = os.path.join(HERE, "fixtures", "models", "tiny-llama3")
OUT = os.path.join(HERE, "fixtures", "lora")
PROMPTS = [[68, 76, 191, 105, 154, 28, 117, 25, 163, 44], [5, 99, 200, 13, 42, 7], [150, 3, 88, 61, 240, 17, 9, 130]]
GREEDY_TOKENS = 16

ADAPTERS = {
    # attention only, alpha / r scaling
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    # all seven projections, rsLoRA (alpha / sqrt(r))
    "all-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"]),
    # the MLP and two attention projections, the largest rank
    "mlp-r16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
}


def greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                             min_new_tokens=GREEDY_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def base_model():
    return AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()


def main() -> None:
    golden = {"prompts": PROMPTS, "max_tokens": GREEDY_TOKENS, "base": [greedy(base_model(), p) for p in PROMPTS],
              "adapters": {}, "peft": peft.__version__}
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed + 1)
        model = get_peft_model(base_model(), LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **kw))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
        model.eval()
        folder = os.path.join(OUT, name)
        model.save_pretrained(folder)
        os.remove(os.path.join(folder, "README.md"))            # peft's model card template
        with open(os.path.join(folder, "adapter_config.json")) as f:
            config = json.load(f)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:   # not this machine's path
            json.dump(config | {"base_model_name_or_path": "tiny-llama3"}, f, indent=2)
        golden["adapters"][name] = [greedy(model, p) for p in PROMPTS]
    for outs in golden["adapters"].values():
        assert outs != golden["base"], "an adapter that does not change the greedy path tests nothing"
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)


if __name__ == "__main__":
    main()
