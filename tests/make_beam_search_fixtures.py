"""Golden beam searches from HF transformers (the oracle) for tests/llm/test_beam_search.py.

Run with the oracle env (torch + transformers):  .venv-oracle/bin/python tests/make_beam_search_fixtures.py

Writes tests/fixtures/beam_search_golden.json: the embedded SmolLM2 GGUF loaded by HF in float32 (gguf_file=),
and for each case (prompt ids, beam width, length penalty, max new tokens) what
``generate(num_beams=..., length_penalty=..., do_sample=False, num_return_sequences=num_beams)`` returns: every
beam's generated ids (up to and including its EOS) and its score (HF's ``sequences_scores``: the summed
logprobs over the generated length, EOS included, to the power ``length_penalty``), best first.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from make_model_fixtures import load_smollm2, smollm2_path, smollm2_prompt_ids  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "beam_search_golden.json")

# (kind, prompt, beam width, length penalty, max new tokens): chat answers that end in EOS inside the budget
# (finished beams, the early stop), plain text cut at the budget, and length penalties that favour long (2),
# neutral (0) and short (-1) beams
CASES = [
    ("plain", "The quick brown fox", 2, 1.0, 12),
    ("plain", "def fibonacci(n):", 4, 1.0, 12),
    ("chat", "What is the capital of France?", 3, 1.0, 24),
    ("chat", "What is 12 times 7?", 4, 0.0, 24),
    ("chat", "Write a haiku about the sea.", 2, 2.0, 16),
    ("plain", "The capital of France is", 3, -1.0, 10),
]


@torch.no_grad()
def main() -> None:
    tok, model = load_smollm2()
    eos = model.generation_config.eos_token_id
    cases = []
    for kind, prompt, width, penalty, max_new in CASES:
        ids = smollm2_prompt_ids(tok, kind, prompt)
        out = model.generate(torch.tensor([list(ids)]), num_beams=width, length_penalty=penalty,
                             max_new_tokens=max_new, do_sample=False, num_return_sequences=width,
                             eos_token_id=eos, pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
        beams = []
        for seq, score in zip(out.sequences, out.sequences_scores):
            gen = seq[len(ids):].tolist()
            if eos in gen:                   # shorter beams are padded with EOS (pad_token_id)
                gen = gen[:gen.index(eos) + 1]
            beams.append({"ids": gen, "score": float(score), "text": tok.decode(gen, skip_special_tokens=True)})
        cases.append({"kind": kind, "prompt": prompt, "prompt_ids": list(ids), "beam_width": width,
                      "length_penalty": penalty, "max_tokens": max_new, "beams": beams})
        print(kind, repr(prompt), f"width {width} penalty {penalty}:",
              *(f"\n  {b['score']:.4f} {b['text']!r}" for b in beams))
    with open(OUT, "w") as f:
        json.dump({"gguf": smollm2_path()[1], "eos_token_id": eos, "cases": cases,
                   "transformers": __import__("transformers").__version__, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
