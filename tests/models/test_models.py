"""The decoder families against HF transformers (golden fixtures from tests/make_model_fixtures.py).

Greedy decoding runs through the paged KV cache the way the engine will: ragged steps of several requests,
block tables drawn from a shuffled pool, a batched prefill then one decode token per request per step.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import llama
from jaxserve.models.configs import model_config_from_hf
from jaxserve.models.loader import load_model
from support.tiny_models import (FIXTURES, PagedRunner, check_chunked_prefill_matches_hf, check_greedy_matches_hf,
                         check_logits_match_hf, golden, hf_logits, load_tiny)

TINY = ["tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-llama-tied", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3",
        "tiny-gemma3-mm", "tiny-phi3", "tiny-cohere"]


# ---------------------------------------------------------------------------------------- tiny families
@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    return load_tiny(request.param)


def test_tiny_logits_match_hf(tiny):
    check_logits_match_hf(*tiny)


def test_tiny_chunked_prefill_matches_hf(tiny):
    check_chunked_prefill_matches_hf(*tiny)


def test_tiny_greedy_matches_hf(tiny):
    check_greedy_matches_hf(*tiny)


def test_tiny_bfloat16_close_to_hf():
    """bfloat16 (the checkpoint's dtype, so dtype=auto) runs and stays close to HF float32."""
    model = load_model(os.path.join(FIXTURES, "tiny-llama3"))
    assert model.dtype == jnp.bfloat16 and model.params["layers"][0]["q"].dtype == jnp.bfloat16
    hf = hf_logits("tiny-llama3")
    logits = PagedRunner(model, max_reqs=1, max_len=16).prompt_logits(golden("tiny-llama3")["prompt_ids"])
    assert logits.dtype == np.float32
    assert np.abs(logits - hf).max() <= 0.05 * np.abs(hf).max()
    assert (logits.argmax(-1) == hf.argmax(-1)).mean() >= 0.8


# -------------------------------------------------------------------------------------------- configs
def test_llama3_rope_bands():
    """llama3 scaling keeps high frequencies, divides low ones by the factor, smooths in between."""
    cfg = model_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 64,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                                "rope_theta": 10000.0, "rope_scaling": {
                                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}})
    plain = llama.rope_inv_freq(cfg.__class__(**{**cfg.__dict__, "rope_scaling": None}))
    scaled = llama.rope_inv_freq(cfg)
    wavelen = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wavelen < 8], plain[wavelen < 8])
    np.testing.assert_allclose(scaled[wavelen > 32], plain[wavelen > 32] / 8, rtol=1e-6)
    mid = (wavelen >= 8) & (wavelen <= 32)
    assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


def test_gguf_rope_freqs_equal_llama3_scaling():
    """A Llama 3.1 GGUF stores llama3 scaling as rope_freqs (llama.cpp's convert_hf_to_gguf formula);
    dividing by them gives transformers' llama3 inverse frequencies."""
    from jaxserve.models.gguf_loader import model_config_from_gguf

    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.feed_forward_length": 8, "llama.block_count": 1, "llama.vocab_size": 8,
            "llama.rope.freq_base": 10000.0, "llama.context_length": 256}
    base = model_config_from_gguf(meta, set())
    factor, low, high, old_len = 8.0, 1.0, 4.0, 32
    factors = []
    for freq in llama.rope_inv_freq(base):
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    gguf_cfg = model_config_from_gguf(meta, {"rope_freqs.weight"}, rope_freqs=np.array(factors, np.float32))
    hf_cfg = model_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 64,
                                   "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                                   "rope_theta": 10000.0, "rope_scaling": {
                                       "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                       "high_freq_factor": high, "original_max_position_embeddings": old_len}})
    np.testing.assert_allclose(llama.rope_inv_freq(gguf_cfg), llama.rope_inv_freq(hf_cfg), rtol=1e-6)
    hash(gguf_cfg)


@pytest.mark.parametrize("case", ["yarn", "yarn-mscale", "llama3", "linear"])
def test_rope_variants_match_transformers(case):
    """Inverse frequencies and the cos/sin attention factor as transformers computes them (rope_golden.json)."""
    with open(os.path.join(FIXTURES, "rope_golden.json")) as f:
        golden = json.load(f)[case]
    rotary = llama.decoder_spec(model_config_from_hf(golden["config"])).rotaries[0]
    np.testing.assert_allclose(rotary.inv_freq, golden["inv_freq"], rtol=1e-6)
    assert rotary.attention_factor == pytest.approx(golden["attention_factor"], rel=1e-6)


@pytest.mark.parametrize("name,expect", [
    ("llama-3.1-8b", dict(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256,
                          rope_theta=500000.0, eos_token_ids=(128001, 128008, 128009))),
    ("llama-3.2-1b", dict(num_layers=16, num_kv_heads=8, head_dim=64, tie_word_embeddings=True)),
    ("qwen2.5-7b", dict(num_layers=28, num_heads=28, num_kv_heads=4, attention_bias=True, vocab_size=152064,
                        sliding_window=None)),
    ("mistral-7b", dict(num_layers=32, num_kv_heads=8, vocab_size=32768, rope_theta=1e6, sliding_window=None)),
])
def test_shipped_dummy_configs(name, expect):
    from jaxserve.models.configs import read_json
    from jaxserve.models.packaged import DUMMY_CONFIG_DIR

    cfg = model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / f"{name}.json")))
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key
    if name.startswith("llama-3"):
        assert cfg.rope_scaling_dict["rope_type"] == "llama3"
    hash(cfg)  # a static jit argument


# ------------------------------------------------------------------------------------- the real SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    with open(os.path.join(FIXTURES, "smollm2_golden.json")) as f:
        golden = json.load(f)
    return load_model(None, dtype="float32"), golden


def test_smollm2_chat_template_ids_match_hf(smollm2):
    model, golden = smollm2
    assert model.chat_template and "<|im_start|>" in model.chat_template
    for case in golden["cases"]:
        if case["kind"] == "chat":
            ids = model.tokenizer.apply_chat_template([{"role": "user", "content": case["prompt"]}],
                                                      add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"]
        else:
            ids = model.tokenizer(case["prompt"])["input_ids"]
        assert list(ids) == case["prompt_ids"], case["prompt"]
    assert model.generation_config["eos_token_id"] == [golden["eos_token_id"]]


def test_smollm2_greedy_matches_hf(smollm2):
    """All prompts decoded together in one ragged batch; each continuation equals HF float32 greedy."""
    model, golden = smollm2
    cases = golden["cases"]
    prompts = [c["prompt_ids"] for c in cases]
    n = golden["max_new_tokens"]
    runner = PagedRunner(model, max_reqs=8, max_len=max(map(len, prompts)) + n, block_size=16)
    out = runner.greedy(prompts, n, prefill_tokens=128)
    for case, got in zip(cases, out):
        expected = case["greedy_ids"]
        assert got[:len(expected)] == expected, case["prompt"]
    paris = next(c for c in cases if "France" in c["prompt"])
    text = model.tokenizer.decode(out[cases.index(paris)][:len(paris["greedy_ids"])], skip_special_tokens=True)
    assert "Paris" in text
