"""Orbax checkpoints: convert → restore gives bit-identical weights and identical greedy output, the folder is
self-contained (config, tokenizer, chat template), and a checkpoint written sharded at one
tensor_parallel_size restores into another mesh's sharding (in a subprocess with 4 fake CPU devices).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pytest

import support
from support.fake_devices import fake_device_report
from support.tiny_models import params_equal

FIXTURES = os.path.join(support.FIXTURES, "models")
TINY = os.path.join(FIXTURES, "tiny-llama3")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from jaxserve.models import orbax_io
    out = str(tmp_path_factory.mktemp("orbax") / "tiny-llama3")
    summary = orbax_io.convert(TINY, out, dtype="float32")
    return out, summary


def test_round_trip_weights_and_logits(converted):
    from jaxserve.models import load_model
    from support.tp_greedy import GreedyDecoder

    out, summary = converted
    original = load_model(TINY, dtype="float32")
    restored = load_model(out, load_format="orbax")
    assert restored.load_format == "orbax" and restored.config == original.config
    assert params_equal(restored.params, original.params)
    tokens_a, logits_a = GreedyDecoder(original.config, original.params, max_new_tokens=4).generate()
    tokens_b, logits_b = GreedyDecoder(restored.config, restored.params, max_new_tokens=4).generate()
    assert tokens_a == tokens_b
    np.testing.assert_array_equal(logits_a, logits_b)
    assert summary["bytes"] == sum(x.nbytes for x in __import__("jax").tree.leaves(original.params))


def test_parallel_reads_restore_the_same_weights_as_one_at_a_time(converted, monkeypatch):
    """JAXSERVE_LOAD_THREADS sets orbax's bound on the bytes read and not yet placed: 0 reads about one
    weight at a time, 8 many at once; the weights are bit-identical."""
    import orbax.checkpoint as ocp
    from jaxserve.models import load_model

    out, _ = converted
    bounds, real = [], ocp.StandardCheckpointer

    def recording(**kw):
        bounds.append(kw["restore_concurrent_gb"])
        return real(**kw)
    monkeypatch.setattr(ocp, "StandardCheckpointer", recording)
    loads = {}
    for threads in (0, 8):
        monkeypatch.setenv("JAXSERVE_LOAD_THREADS", str(threads))
        loads[threads] = load_model(out, dtype="bfloat16")     # stored float32: a read is the float32 bytes
    assert params_equal(loads[0].params, loads[8].params)
    largest = 256 * 64 * 4                                      # the float32 embedding
    assert bounds[0] * 1e9 == pytest.approx(largest + 1) and bounds[1] > 2 * bounds[0]


def test_folder_is_self_contained_and_auto_detected(converted):
    from jaxserve.models import load_model
    from jaxserve.models.orbax_io import MARKER

    out, _ = converted
    auto = load_model(out)                     # load_format="auto" recognises the folder
    assert auto.load_format == "orbax"
    original = load_model(TINY, dtype="float32")
    assert auto.generation_config == original.generation_config
    assert auto.chat_template == original.chat_template
    text = "The quick brown fox"
    assert auto.tokenizer.encode(text) == original.tokenizer.encode(text)
    meta = json.load(open(os.path.join(out, MARKER)))
    assert meta["source"] == TINY and meta["dtype"] == "float32"


def test_dtype_at_convert_and_at_load(converted, tmp_path):
    import jax.numpy as jnp
    from jaxserve.models import load_model, orbax_io

    bf16_dir = str(tmp_path / "bf16")
    orbax_io.convert(TINY, bf16_dir, dtype="bfloat16")
    as_bf16 = load_model(bf16_dir)
    assert params_equal(as_bf16.params, load_model(TINY, dtype="bfloat16").params)
    # a float32 checkpoint cast at restore time
    out, _ = converted
    assert params_equal(load_model(out, dtype="bfloat16").params, as_bf16.params)
    assert as_bf16.dtype == jnp.bfloat16


def test_errors_are_actionable(converted, tmp_path):
    from jaxserve.errors import ModelLoadError
    from jaxserve.models import load_model, orbax_io

    out, _ = converted
    with pytest.raises(ModelLoadError, match="already exists and is not empty"):
        orbax_io.convert(TINY, out)
    with pytest.raises(ModelLoadError, match="not a jaxserve orbax checkpoint .* python -m jaxserve convert"):
        load_model(TINY, load_format="orbax")
    import shutil
    broken = tmp_path / "no-params"
    broken.mkdir()
    shutil.copy(os.path.join(out, orbax_io.MARKER), broken)     # the marker without the weights
    with pytest.raises(ModelLoadError, match="cannot restore the orbax checkpoint"):
        load_model(str(broken))


def test_cli_pair(tmp_path, capsys):
    from jaxserve.models import load_model, orbax_io

    parser = orbax_io.add_convert_args(argparse.ArgumentParser())
    args = parser.parse_args([TINY, "--output", str(tmp_path / "cli"), "--dtype", "float32"])
    assert orbax_io.run_convert(args) == 0
    assert "wrote" in capsys.readouterr().out
    assert load_model(str(tmp_path / "cli")).load_format == "orbax"


def test_greedy_through_the_engine(converted):
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    out, _ = converted
    prompts = [[5, 17, 99, 3, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2,
              kv_cache_memory_bytes=1 << 20, skip_warmup=True, use_tqdm_on_load=False)
    from_orbax = LLM(out, **kw).generate(prompts, sp, use_tqdm=False)
    from_safetensors = LLM(TINY, **kw).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in from_orbax] == [o.outputs[0].token_ids for o in from_safetensors]


# ------------------------------------------------------------------------------ sharded save and restore
def _sharded_worker(workdir: str) -> dict:
    import jax

    from jaxserve.models import load_model, orbax_io
    from jaxserve.parallel import make_mesh

    out = os.path.join(workdir, "tp2")
    orbax_io.convert(TINY, out, dtype="float32", tensor_parallel_size=2)   # each device writes its shards
    reference = load_model(TINY, dtype="float32")
    report = {}
    for tp in (1, 2, 4):
        restored = load_model(out, mesh=make_mesh(tp) if tp > 1 else None)
        layer = restored.params["layers"][0]
        report[tp] = {"equal": params_equal(restored.params, reference.params),
                      "q_devices": len(layer["q"].sharding.device_set),
                      "q_spec": str(getattr(layer["q"].sharding, "spec", None)),
                      "k_spec": str(getattr(layer["k"].sharding, "spec", None)),
                      "q_shard_shape": list(layer["q"].addressable_shards[0].data.shape)}
    assert jax.device_count() == 4
    return report


def test_sharded_checkpoint_restores_at_any_tp(tmp_path):
    report = fake_device_report([__file__, str(tmp_path)], 4, timeout=600)
    assert all(report[tp]["equal"] for tp in report)
    assert report["1"]["q_devices"] == 1
    assert report["2"]["q_spec"] == "P(None, 'tp')" and report["2"]["q_shard_shape"] == [64, 32]
    assert report["4"]["q_devices"] == 4 and report["4"]["q_shard_shape"] == [64, 16]
    # tiny-llama3 has 2 kv heads: at tp=4 the k/v projections restore replicated (whole heads per device)
    assert report["4"]["k_spec"] == "P()" and report["2"]["k_spec"] == "P(None, 'tp')"


if __name__ == "__main__":
    print(json.dumps(_sharded_worker(sys.argv[1])))
