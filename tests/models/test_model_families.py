"""Every decoder family through the engine (``LLM``, float32, CPU) against HF transformers' greedy ids.

The tiny random checkpoints of tests/make_model_fixtures.py (sliding windows of 8 for Gemma, LongRoPE past
position 32 for Phi-3) decode HF's prompt three times in one batch with other requests: prefix caching on
(the copies share the prompt's blocks), chunked prefill of 8-token chunks (the 10-token prompt's second
chunk reads keys across the window boundary), and a block pool too small for the batch, so the scheduler
preempts and recomputes. Every copy must give HF's 32 tokens. Tensor parallelism (2 and 4 fake CPU devices,
in a subprocess: the device count is fixed when JAX starts) must give HF's tokens too.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import ModelLoadError
from jaxserve.models import registry
from jaxserve.models.configs import model_config_from_folder, model_config_from_hf, read_json
from jaxserve.models.packaged import DUMMY_CONFIG_DIR
import support
from support.fake_devices import fake_device_report
from support.goldens import load_golden
from support.tiny_models import check_orbax_round_trip, engine_with_preemption

FIXTURES = os.path.join(support.FIXTURES, "models")
FAMILIES = ["tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-cohere"]


# the windowed and LongRoPE families in the default run; Qwen3 and Command-R (whose paged greedy decoding
# tests/models/test_models.py checks) with the slow tests
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("tiny-qwen3", "tiny-cohere") else n
                                  for n in FAMILIES])
def test_engine_greedy_matches_hf(name):
    llm, golden, outs = engine_with_preemption(name)
    stats = llm.engine.core.scheduler.get_stats()
    assert stats["num_preemptions"] > 0, stats
    for i in (0, 2, 4):
        assert outs[i].outputs[0].token_ids == golden["greedy_ids"], f"{name}: copy {i} differs from HF"
    assert llm.engine.core.kv_manager.usage == 0.0


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_chat_template_and_eos_ids_come_from_the_checkpoint(tmp_path):
    """A checkpoint's own chat template (Gemma's turn markers) and generation_config eos ids reach the
    offline API (the tiny model's 256-token vocabulary cannot take the rendered prompt, so nothing is generated)."""
    import shutil

    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(FIXTURES, "tiny-gemma2", f), tmp_path)
    tokenizers = os.path.join(os.path.dirname(FIXTURES), "..", "..", "configs", "tokenizers", "smollm2")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizers, f), tmp_path)
    (tmp_path / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2,
              kv_cache_memory_bytes=1 << 22, skip_warmup=True, compilation_cache_dir="", use_tqdm_on_load=False)
    ids = llm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert llm.get_tokenizer().decode(ids) == "<|im_start|><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert llm.engine.core.model.generation_config["eos_token_id"] == [2, 7]


def test_orbax_convert_round_trip(tmp_path):
    """``convert`` keeps a family's config (its extra hyper-parameters included) and weights bit for bit."""
    check_orbax_round_trip("tiny-gemma3", str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_server_serves_a_family():
    """``python -m jaxserve serve <Gemma 2 checkpoint>``: an OpenAI completion from token ids gives HF's tokens
    (the tiny model's vocabulary is too small for text prompts)."""
    import httpx
    from support.server_process import XLA_CACHE_FLAGS, ServerProcess

    from jaxserve.models.tokenizers import embedded_tokenizer

    golden = load_golden(os.path.join(FIXTURES, "tiny-gemma2", "golden.json"))
    srv = ServerProcess(os.path.join(FIXTURES, "tiny-gemma2"), "--dtype", "float32", "--max-model-len", "64",
                        "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--served-model-name", "gemma",
                        *XLA_CACHE_FLAGS)
    try:
        body = {"model": "gemma", "prompt": golden["prompt_ids"], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == 8
        tokenizer = embedded_tokenizer()    # the checkpoint ships none: the server uses the embedded one
        assert choice["text"] == tokenizer.decode(golden["greedy_ids"][:8], skip_special_tokens=True)
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name,architecture,billions,windows", [
    ("qwen3-8b", "Qwen3ForCausalLM", 8.19, {None}),
    ("gemma-2-9b", "Gemma2ForCausalLM", 9.24, {4096, None}),
    ("gemma-3-12b", "Gemma3ForCausalLM", 11.77, {1024, None}),
    ("phi-3-mini", "Phi3ForCausalLM", 3.82, {2047}),
    ("phi-4", "Phi3ForCausalLM", 14.66, {None}),
    ("command-r-35b", "CohereForCausalLM", 34.98, {None}),
    ("qwen2.5-vl-7b", "Qwen2_5_VLForConditionalGeneration", 8.29, {None}),
    ("qwen2-vl-7b", "Qwen2VLForConditionalGeneration", 8.29, {None}),
    ("gemma-3-4b-vision", "Gemma3ForConditionalGeneration", 4.30, {1024, None}),
])
def test_shipped_dummy_configs(name, architecture, billions, windows):
    import jax

    hf = read_json(str(DUMMY_CONFIG_DIR / f"{name}.json"))
    cfg = model_config_from_hf(hf)
    arch, family = registry.resolve_architecture(hf["architectures"])
    family.check_config(cfg)
    hash(cfg)   # a static jit argument
    shapes = jax.tree.leaves(family.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert arch == architecture
    assert sum(int(np.prod(s)) for s in shapes) / 1e9 == pytest.approx(billions, abs=0.01)
    spec = family.decoder_spec(cfg)
    assert set(spec.windows) == windows
    if name == "gemma-3-12b":   # five local layers to one global, the local ones on their own RoPE base
        assert spec.windows[:6] == (1024,) * 5 + (None,) and spec.layer_rotary[:6] == (1,) * 5 + (0,)
        assert spec.rotaries[0].inv_freq != spec.rotaries[1].inv_freq


def test_each_name_belongs_to_one_family():
    """The registry's lookups come from what each family declares: an architecture, a model_type or a GGUF
    architecture is served by one family, and a model_type's architecture is one of its family's."""
    families = registry.decoder_families() + registry.encoder_families()
    for names in ([a for f in families for a in f.architectures],
                  [t for f in registry.decoder_families() for t in f.model_types],
                  [g for f in registry.decoder_families() for g in f.gguf]):
        assert len(names) == len(set(names)), names
    for family in registry.decoder_families():
        assert set(family.model_types.values()) <= set(family.architectures), family.architectures
        assert registry.resolve_architecture(family.architectures[0])[1] is family
        assert all(registry.family_of_model_type(t) is family for t in family.model_types)
    assert registry.family_of_model_type("bert") is None and registry.is_encoder("BertModel")


def test_gemma3_multimodal_config_serves_its_text_model():
    """A hub Gemma 3 config lists only what differs from transformers' defaults in its text_config; the text
    model read from it is the text-only gemma-3-12b config's, with its SigLIP tower beside it."""
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                           "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    cfg = model_config_from_hf(hub)
    text_only = model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / "gemma-3-12b.json")))
    _, family = registry.resolve_architecture(cfg.architecture)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.eos_token_ids == (1, 106)
    assert family.decoder_spec(cfg) == family.decoder_spec(text_only)
    _, text_family = registry.resolve_architecture(text_only.architecture)
    shapes = family.param_shapes(cfg)
    assert {k: v for k, v in shapes.items() if k not in ("vision", "projector")} == \
        text_family.param_shapes(text_only)
    # the vision model: SigLIP-So400m at 896 pixels, 4096 patches pooled to 256 tokens
    assert shapes["vision"]["pos_embed"] == (4096, 1152) and shapes["projector"]["proj"] == (1152, 3840)
    assert cfg.extra_dict["mm_tokens_per_image"] == 256 and family.bidirectional_images
    family.check_config(cfg)


@pytest.mark.parametrize("name,change,field", [
    ("tiny-qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("tiny-cohere", {"use_qk_norm": True}, "use_qk_norm"),
    ("tiny-gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("tiny-gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("tiny-qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "dynamic"),
    ("tiny-phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                       "long_factor": [1.0]}}, "long_factor"),
])
def test_configs_a_family_would_get_wrong_are_refused(name, change, field):
    hf = read_json(os.path.join(FIXTURES, name, "config.json")) | change
    with pytest.raises(ModelLoadError, match=field):
        cfg = model_config_from_hf(hf)
        _, family = registry.resolve_architecture(hf["architectures"])
        family.check_config(cfg)
        family.decoder_spec(cfg)


# --------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("soft_cap,window", [(None, None), (50.0, 24)])
def test_pallas_attention_head_dim_256(soft_cap, window):
    """Gemma's attention shape (head_dim 256, 2:1 GQA; Gemma 2's soft-cap on its sliding layers) in the Pallas
    kernels (interpret mode) against the reference: decodes and prefill chunks in one ragged step."""
    import jax.numpy as jnp

    from support import synthetic
    from jaxserve.kernels import paged_attention_pallas as pa
    from jaxserve.kernels import ref_attention

    rng = np.random.default_rng(256)
    q, k, v, md = synthetic.make_batch(rng, [1, 9, 1, 20], [40, 9, 3, 53], block_size=16, num_q_heads=4,
                                       num_kv_heads=2, head_dim=256, dtype=jnp.float32, pad_tokens=3, pad_reqs=1)
    kw = dict(sm_scale=256 ** -0.5, soft_cap=soft_cap, sliding_window=window)
    ref = np.asarray(ref_attention.ragged_paged_attention(q, k, v, md, **kw))
    out = np.asarray(pa.ragged_paged_attention(q, k, v, md, interpret=True, poison_output=True, decode_block_k=16,
                                               prefill_block_m=16, prefill_block_k=16, **kw))
    n = int(md.query_start_loc[int(md.num_seqs)])
    assert not np.isnan(out[:n]).any()
    assert np.abs(out[:n] - ref[:n]).max() <= 1e-4 * np.abs(ref[:n]).max()


def test_a_window_covering_the_block_table_runs_as_global_attention(monkeypatch):
    """A sliding window at least as long as a request can reach (block table width x block size) masks no key,
    so the layer calls the attention as a global one (Gemma 2 served at max_model_len <= 4096); a shorter
    window stays. Gemma 2's alternating layers, traced at two block-table widths."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.metadata import AttentionMetadata
    from jaxserve.models.layers import decoder

    cfg, _, _ = model_config_from_folder(os.path.join(FIXTURES, "tiny-gemma2"))
    family = registry.resolve_architecture(["Gemma2ForCausalLM"])[1]
    window = cfg.sliding_window
    seen = []
    real = decoder.tp_attention.write_kv_and_attend

    def record(*args, sliding_window=None, **kw):
        seen.append(sliding_window)
        return real(*args, sliding_window=sliding_window, **kw)

    monkeypatch.setattr(decoder.tp_attention, "write_kv_and_attend", record)
    params = family.init_dummy_params(cfg, jnp.float32)
    block_size = 4
    for pages, expect in ((window // block_size, None), (window // block_size + 1, window)):
        caches = [(jnp.zeros((pages + 1, cfg.num_kv_heads, block_size, cfg.head_dim)),) * 2
                  for _ in range(cfg.num_layers)]
        md = AttentionMetadata(slot_mapping=jnp.array([4], jnp.int32), block_tables=jnp.ones((1, pages), jnp.int32),
                               seq_lens=jnp.array([1], jnp.int32), query_start_loc=jnp.array([0, 1], jnp.int32),
                               num_seqs=jnp.int32(1))
        seen.clear()
        jax.eval_shape(lambda p, kv: family.forward(p, kv, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), md,
                                                    cfg), params, caches)
        types = cfg.extra_dict["layer_types"]
        assert seen == [expect if t == "sliding_attention" else None for t in types], (pages, seen)


# ------------------------------------------------------------------------------------ tensor parallelism
TP_SIZES = (2, 4)


def _tp_worker() -> dict:
    """HF's prompt decoded greedily at each TP size, per family (runs with 4 fake CPU devices)."""
    import jax

    assert jax.device_count() == max(TP_SIZES), jax.devices()
    report = {}
    for name in FAMILIES:
        golden = load_golden(os.path.join(FIXTURES, name, "golden.json"))
        for tp in TP_SIZES:
            llm = LLM(os.path.join(FIXTURES, name), tensor_parallel_size=tp, dtype="float32", max_model_len=64,
                      max_num_batched_tokens=16, max_num_seqs=2, kv_cache_memory_bytes=1 << 22, skip_warmup=True,
                      compilation_cache_dir="", use_tqdm_on_load=False)
            params = SamplingParams(temperature=0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
            out = llm.generate([golden["prompt_ids"]], params, use_tqdm=False)[0].outputs[0].token_ids
            report[f"{name}/tp{tp}"] = list(out) == golden["greedy_ids"]
            report[f"{name}/tp{tp}/q_spec"] = str(llm.engine.core.model.params["layers"][0]["q"].sharding.spec)
            del llm
    return report


@pytest.fixture(scope="module")
def tp_report():
    return fake_device_report([__file__, "tp"], max(TP_SIZES), timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", FAMILIES)
def test_tensor_parallel_greedy_matches_hf(tp_report, name, tp):
    assert tp_report[f"{name}/tp{tp}"], f"{name} at tensor_parallel_size={tp} differs from HF"
    assert tp_report[f"{name}/tp{tp}/q_spec"] == "P(None, 'tp')"


if __name__ == "__main__" and sys.argv[1:] == ["tp"]:
    print(json.dumps(_tp_worker()))


def _reductions_per_layer(family, **shape) -> int:
    """``stablehlo.reduce`` ops one more layer adds to a decode forward (reference attention)."""
    import re

    import jax
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.kernels import ops
    from jaxserve.kernels.metadata import AttentionMetadata

    def count(layers: int) -> int:
        cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=layers,
                          num_heads=4, num_kv_heads=2, head_dim=16, **shape)
        params = jax.eval_shape(lambda: family.init_dummy_params(cfg, jnp.bfloat16))
        caches = ops.init_kv_caches(layers, 4, 16, 2, 16, jnp.bfloat16)
        md = AttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32), block_tables=jnp.zeros((4, 4), jnp.int32),
                               seq_lens=jnp.ones(4, jnp.int32), query_start_loc=jnp.arange(5, dtype=jnp.int32),
                               num_seqs=jnp.int32(4), decode_only=True)
        step = jax.jit(lambda p, kv, ids: family.forward(p, kv, ids, ids, md, cfg))
        return len(re.findall(r"stablehlo\.reduce\b", step.lower(params, caches, jnp.zeros(4, jnp.int32)).as_text()))

    return count(2) - count(1)


def test_qk_norm_costs_one_reduction_per_layer():
    """Qwen3's q- and k-norms share one reduction (each reduction is a GPU kernel of its own at batch 1)."""
    from jaxserve.models import llama, qwen3

    assert _reductions_per_layer(qwen3.FAMILY) == _reductions_per_layer(llama.FAMILY) + 1
