"""GGUF files of the Qwen3, Gemma 2, Phi-3 and Command-R families load to the model their safetensors give.

Each tiny HF fixture is written as a GGUF the way llama.cpp's converter writes one: tensor names from the
gguf package's own name map (not jaxserve's), float32 data in HF layout, Gemma's norms stored as ``1 + w``,
Phi-3's fused projections kept and its LongRoPE factors stored as tensors, and only the metadata llama.cpp
stores (so Gemma 2's ``query_pre_attn_scalar`` is head_dim, as llama.cpp hard-codes it; the safetensors side
uses the same value). The GGUF load must give the same decoder, the same weights and the same logits.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models import gguf_loader, registry
from jaxserve.models.loader import load_model
from jaxserve.models.safetensors_loader import SafetensorsFile
import support
from support.tiny_models import PagedRunner

from jaxserve.benchmarks.models import resolve_model

gguf = pytest.importorskip("gguf")

FIXTURES = os.path.join(support.FIXTURES, "models")
ARCHS = {"tiny-qwen3": gguf.MODEL_ARCH.QWEN3, "tiny-gemma2": gguf.MODEL_ARCH.GEMMA2,
         "tiny-phi3": gguf.MODEL_ARCH.PHI3, "tiny-cohere": gguf.MODEL_ARCH.COMMAND_R}


def _vocab(writer, size: int) -> None:
    """A SentencePiece vocabulary of ``size`` tokens (three control tokens, then plain pieces)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(size - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(size - 3)])
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (size - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def gguf_writer(path: str, arch, hf: dict):
    """A GGUFWriter for ``arch`` with the shape keys every decoder family writes, from HF's config.json."""
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    return w


def write_gguf(folder: str, path: str) -> None:
    """The fixture in ``folder`` as a float32 GGUF at ``path``, as llama.cpp's convert_hf_to_gguf.py writes."""
    arch = ARCHS[os.path.basename(folder)]
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    rope = hf.get("rope_parameters") or {}
    layers, hidden, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    w = gguf_writer(path, arch, hf)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if arch == gguf.MODEL_ARCH.COMMAND_R:
        w.add_layer_norm_eps(hf["layer_norm_eps"])
        w.add_logit_scale(hf["logit_scale"])
    else:
        w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if arch in (gguf.MODEL_ARCH.QWEN3, gguf.MODEL_ARCH.GEMMA2):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        w.add_sliding_window(hf["sliding_window"])
    factors = {}
    if arch == gguf.MODEL_ARCH.PHI3:
        w.add_rope_dimension_count(int(hf["partial_rotary_factor"] * hidden) // heads)
        w.add_sliding_window(hf.get("sliding_window") or 0)
        original = hf["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = hf["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        factors = {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}
    _vocab(w, hf["vocab_size"])
    names = gguf.get_tensor_name_map(arch, layers)
    st = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    for hf_name in st.names():
        data = np.asarray(st.get(hf_name), np.float32)
        if arch == gguf.MODEL_ARCH.GEMMA2 and hf_name.endswith("norm.weight"):
            data = data + 1.0              # llama.cpp's Gemma RMSNorm multiplies by the stored weight itself
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    for name, values in factors.items():
        w.add_tensor(name, np.asarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _folder_as_gguf_describes_it(name: str, tmp_path) -> str:
    """The fixture folder, with Gemma 2's query_pre_attn_scalar set to what a GGUF implies (head_dim)."""
    src = os.path.join(FIXTURES, name)
    if name != "tiny-gemma2":
        return src
    dst = tmp_path / name
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_gguf_loads_what_the_safetensors_give(name, tmp_path):
    folder = _folder_as_gguf_describes_it(name, tmp_path)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(os.path.join(FIXTURES, name), path)
    want, got = load_model(folder, dtype="float32"), load_model(path, dtype="float32")
    assert got.load_format == "gguf" and got.config.architecture == want.config.architecture
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rms_norm_eps", "tie_word_embeddings", "sliding_window", "hidden_act"):
        assert getattr(got.config, field) == getattr(want.config, field), field
    # the same decoder: norms, windows, soft-caps, scales and every RoPE table (LongRoPE factors included)
    assert got.family.decoder_spec(got.config) == want.family.decoder_spec(want.config)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want.params))
    for key, value in jax.tree_util.tree_leaves_with_path(got.params):
        np.testing.assert_allclose(np.asarray(value), np.asarray(flat_want[key]), atol=1e-6,
                                   err_msg=jax.tree_util.keystr(key))
    prompt = [5, 17, 3, 99, 42, 7, 200, 11, 64, 1]
    logits = [PagedRunner(m, max_reqs=1, max_len=16).step([(0, prompt, 0)], 16, logits_rows=list(range(10)))
              for m in (want, got)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-5
    # the benchmark harness reads the same config without loading the weights (its roofline counts)
    assert resolve_model({"model": {"path": path, "name": None}})[0] == got.config


def test_gguf_config_is_what_llama_cpp_implies():
    """The values llama.cpp hard-codes or stores elsewhere, read back for each architecture."""
    def meta(arch: str, **extra):
        base = {"embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
                "block_count": 46, "feed_forward_length": 96, "context_length": 256, "vocab_size": 256}
        return {"general.architecture": arch, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.tokens": ["<pad>", "<s>", "</s>", "<end_of_turn>", "<|end|>", "<|im_end|>"],
                **{f"{arch}.{k}": v for k, v in (base | extra).items()}}

    g2 = gguf_loader.gguf_hf_config(meta("gemma2", **{"attention.key_length": 32, "attention.sliding_window": 16,
                                                 "attn_logit_softcapping": 50.0}), set())
    assert g2["model_type"] == "gemma2" and g2["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert g2["query_pre_attn_scalar"] == 16          # the 46-layer (27B) shape: hidden / heads, not head_dim
    assert g2["attn_logit_softcapping"] == 50.0 and g2["final_logit_softcapping"] is None
    assert g2["eos_token_id"] == [2, 3] and g2["tie_word_embeddings"]
    phi = gguf_loader.gguf_hf_config(meta("phi3", **{"rope.dimension_count": 8, "attention.sliding_window": 0}),
                                {"output.weight"})
    assert phi["partial_rotary_factor"] == 0.5 and phi["sliding_window"] is None and phi["eos_token_id"] == [2, 4]
    assert phi["rope_scaling"] is None and not phi["tie_word_embeddings"]
    with pytest.raises(ModelLoadError, match="rope_factors_long and rope_factors_short"):
        gguf_loader.gguf_hf_config(meta("phi3"), {"rope_factors_long.weight"})
    assert gguf_loader.gguf_hf_config(meta("qwen3"), set())["eos_token_id"] == [2, 5]
    cohere = gguf_loader.gguf_hf_config(meta("command-r", logit_scale=0.0625,
                                        **{"attention.layer_norm_epsilon": 1e-5}), set())
    assert cohere["logit_scale"] == 0.0625 and cohere["layer_norm_eps"] == 1e-5
    assert gguf_loader.gguf_hf_config(meta("llama"), set()) is None        # llama.model_config_from_gguf's
    assert registry.gguf_architectures() == ("llama", "qwen2", "gemma2", "gemma3", "qwen3", "phi3", "command-r",
                                             "qwen2moe", "qwen3moe")
    with pytest.raises(ModelLoadError, match="'mamba' is not supported; supported: llama, qwen2, gemma2"):
        gguf_loader.model_config_from_gguf({"general.architecture": "mamba"}, set())
    with pytest.raises(ModelLoadError, match="qwen3.embedding_length"):
        gguf_loader.gguf_hf_config({"general.architecture": "qwen3"}, set())


def test_gguf_names_map_the_fused_and_extra_norm_tensors():
    assert gguf_loader.gguf_name("model.layers.3.self_attn.qkv_proj.weight", "phi3") == "blk.3.attn_qkv.weight"
    assert gguf_loader.gguf_name("model.layers.3.mlp.gate_up_proj.weight", "phi3") == "blk.3.ffn_up.weight"
    assert gguf_loader.gguf_name("model.layers.0.self_attn.k_norm.weight", "qwen3") == "blk.0.attn_k_norm.weight"
    assert gguf_loader.gguf_name("model.layers.1.pre_feedforward_layernorm.weight", "gemma2") == "blk.1.ffn_norm.weight"
    assert gguf_loader.gguf_name("model.layers.1.post_attention_layernorm.weight", "gemma2") == \
        "blk.1.post_attention_norm.weight"
    assert gguf_loader.gguf_name("model.layers.1.input_layernorm.weight", "command-r") == "blk.1.attn_norm.weight"
