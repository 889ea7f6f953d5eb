"""GGUF files of Qwen2-MoE and Qwen3-MoE (the MoE architectures transformers reads from GGUF) load to the model
their safetensors give; a Mixtral GGUF (llama with experts, which transformers does not read) is refused.

Each tiny HF fixture is written the way llama.cpp's converter writes one: per-expert tensors stacked into one
``ffn_{gate,up,down}_exps`` tensor per layer, names from the gguf package's own map (not jaxserve's), the
shared expert's gate stored as a vector (a dense layer, which llama.cpp's Qwen2-MoE has none of, under the
dense architectures' names), float32 data, and the metadata llama.cpp stores (expert count, top-k,
expert widths; no ``norm_topk_prob`` or ``mlp_only_layers``: those follow from the architecture and the
tensors).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models import gguf_loader
from jaxserve.models.loader import load_model
from jaxserve.models.safetensors_loader import SafetensorsFile
from test_gguf_families import _vocab, gguf_writer
import support
from support.tiny_models import PagedRunner

gguf = pytest.importorskip("gguf")

FIXTURES = os.path.join(support.FIXTURES, "models")
ARCHS = {"tiny-qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "tiny-qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}


def write_moe_gguf(folder: str, path: str) -> None:
    arch = ARCHS[os.path.basename(folder)]
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    layers = hf["num_hidden_layers"]
    w = gguf_writer(path, arch, hf)
    w.add_rope_freq_base((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])   # transformers 5 saves Qwen3-MoE's as the latter
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    else:
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    _vocab(w, hf["vocab_size"])
    names = gguf.get_tensor_name_map(arch, layers)
    st = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    experts: dict[str, list] = {}
    for hf_name in st.names():
        data = np.asarray(st.get(hf_name), np.float32)
        if ".mlp.experts." in hf_name:          # model.layers.<i>.mlp.experts.<e>.<proj>.weight: stacked below
            pre, rest = hf_name.split(".mlp.experts.")
            experts.setdefault(f"{pre}.mlp.experts.{rest.split('.', 1)[1]}", []).append((int(rest.split(".")[0]), data))
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)
        # the fixture's dense layer (mlp_only_layers): llama.cpp's qwen2moe has no such layer, so its name map
        # has no dense MLP tensors; they take the ffn_gate / ffn_up / ffn_down names of the dense architectures
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or
                     gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, layers).get_name(hf_name, try_suffixes=(".weight",)),
                     data)
    for stacked, rows in experts.items():
        w.add_tensor(names.get_name(stacked, try_suffixes=(".weight",)), np.stack([d for _, d in sorted(rows)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_moe_gguf_loads_what_the_safetensors_give(name, tmp_path):
    folder = os.path.join(FIXTURES, name)
    path = str(tmp_path / f"{name}.gguf")
    write_moe_gguf(folder, path)
    want, got = load_model(folder, dtype="float32"), load_model(path, dtype="float32")
    assert got.load_format == "gguf" and got.config.architecture == want.config.architecture
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(got.config, field) == getattr(want.config, field), field
    # the same routing (experts, top-k, renormalisation), shared expert and dense layers (Qwen2-MoE's layer 1)
    assert got.family.decoder_spec(got.config) == want.family.decoder_spec(want.config)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want.params))
    for key, value in jax.tree_util.tree_leaves_with_path(got.params):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_want[key]), err_msg=jax.tree_util.keystr(key))
    with open(os.path.join(folder, "golden.json")) as f:
        prompt = json.load(f)["prompt_ids"]
    logits = PagedRunner(got, max_reqs=1, max_len=16).step([(0, prompt, 0)], 16, logits_rows=list(range(len(prompt))))
    assert np.abs(logits - np.load(os.path.join(folder, "logits.npy"))).max() <= 1e-4, "logits differ from HF"
    ep = load_model(path, dtype="float32", enable_expert_parallel=True)
    assert ep.config.extra_dict["enable_expert_parallel"]


def test_moe_gguf_names_and_mixtral_refused():
    assert gguf_loader.gguf_name("model.layers.2.mlp.gate.weight", "qwen3moe") == "blk.2.ffn_gate_inp.weight"
    assert gguf_loader.gguf_name("model.layers.2.mlp.shared_expert.down_proj.weight", "qwen2moe") == \
        "blk.2.ffn_down_shexp.weight"
    assert gguf_loader.gguf_name("model.layers.2.mlp.shared_expert_gate.weight", "qwen2moe") == \
        "blk.2.ffn_gate_inp_shexp.weight"
    meta = {"general.architecture": "llama", "llama.expert_count": 8, "llama.expert_used_count": 2}
    with pytest.raises(ModelLoadError, match="Mixtral-style .* safetensors"):
        gguf_loader.gguf_hf_config(meta, set())
