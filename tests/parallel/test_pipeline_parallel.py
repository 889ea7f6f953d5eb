"""Pipeline stages on 4 fake CPU devices: PP=2, PP=2 × TP=2, PP=3 and PP=4 engines give transformers' greedy
tokens (HF's prompt three times among three others, prefix caching on, 8-token prefill chunks and a block
pool small enough that the scheduler preempts: ``support.tiny_models.engine_with_preemption``), the other
prompts' tokens equal to one stage's, with the batch queue on and off; each stage holds only its layers'
weights and KV cache; what pipeline stages do not run is refused with the flag to change.

As in test_tensor_parallel.py the checks run in a subprocess started with the fake devices (this file run as
a script), which prints its findings as JSON.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

import support
from support.fake_devices import fake_device_report

NUM_DEVICES = 4


def _engine_case(name: str, **kw) -> dict:
    from support.tiny_models import engine_with_preemption

    llm, gold, outs = engine_with_preemption(name, **kw)
    core = llm.engine.core
    params, caches = core.model.params, core.runner.kv_caches
    entry = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "golden": gold["greedy_ids"],
             "preemptions": core.scheduler.num_preemptions,
             # the devices of each layer's weights and cache, of the embedding and of the final norm
             "layer_devices": [sorted(d.id for d in layer["q"].sharding.device_set) for layer in params["layers"]],
             "cache_devices": [sorted(d.id for d in kv[0].sharding.device_set) for kv in caches],
             "embed_devices": sorted(d.id for d in params["embed"].sharding.device_set),
             "norm_devices": sorted(d.id for d in params["final_norm"].sharding.device_set)}
    del llm
    return entry


def _worker(group: str) -> dict:
    import jax

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    report = {}
    if group == "default":
        report["tiny-llama3/pp1"] = _engine_case("tiny-llama3")
        report["tiny-llama3/pp2"] = _engine_case("tiny-llama3", pipeline_parallel_size=2)
        report["tiny-llama3/pp2xtp2"] = _engine_case("tiny-llama3", pipeline_parallel_size=2, tensor_parallel_size=2)
        report["refused"] = _refusals()
    else:
        report["tiny-llama3/pp1"] = _engine_case("tiny-llama3")
        report["tiny-llama3/pp2-no-queue"] = _engine_case("tiny-llama3", pipeline_parallel_size=2,
                                                          pipeline_batch_queue=False)
        report["tiny-qwen3moe/pp2xtp2"] = _engine_case("tiny-qwen3moe", pipeline_parallel_size=2,
                                                       tensor_parallel_size=2)
        report["tiny-gemma3/pp3"] = _engine_case("tiny-gemma3", pipeline_parallel_size=3)
        report["tiny-gemma3/pp2xtp2"] = _engine_case("tiny-gemma3", pipeline_parallel_size=2, tensor_parallel_size=2)
        report["smollm2"] = _smollm2()
    return report


def _refusals() -> dict:
    from support.tiny_models import tiny_llm

    out = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    for key, kw in {"lora": {"enable_lora": True}, "multi_step": {"num_scheduler_steps": 4},
                    "speculative": {"speculative_config": ngram}, "devices": {"tensor_parallel_size": 4}}.items():
        try:
            tiny_llm(pipeline_parallel_size=2, skip_warmup=True, **kw)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def _smollm2() -> dict:
    """The real SmolLM2 (30 layers) at PP=2 and PP=4 against transformers' greedy ids, batched (its 9 heads
    split 3 ways, not 2: PP × TP would need 6 devices)."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    golden = json.load(open(os.path.join(support.FIXTURES, "models", "smollm2_golden.json")))["cases"][:3]
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4,
              kv_cache_memory_bytes=1 << 26, skip_warmup=True, compilation_cache_dir="", use_tqdm_on_load=False)
    report = {"golden": [c["greedy_ids"] for c in golden]}
    for pp in (2, 4):
        llm = LLM(None, pipeline_parallel_size=pp, **kw)
        outs = llm.generate([c["prompt_ids"] for c in golden],
                            [SamplingParams(temperature=0.0, max_tokens=len(c["greedy_ids"])) for c in golden],
                            use_tqdm=False)
        report[f"pp{pp}"] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    return report


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def report():
    return fake_device_report([__file__, "default"], NUM_DEVICES, timeout=600)


@pytest.fixture(scope="module")
def slow_report():
    return fake_device_report([__file__, "slow"], NUM_DEVICES, timeout=1200)


def _check_case(entry: dict, reference: dict | None = None) -> None:
    for i in (0, 2, 4):         # HF's prompt, three times
        assert entry["tokens"][i] == entry["golden"]
    if reference is not None:   # the other prompts: as one stage decodes them
        assert entry["tokens"] == reference["tokens"]
    assert entry["preemptions"] > 0


@pytest.mark.parametrize("case", ["pp2", "pp2xtp2"])
def test_pipeline_greedy_matches_hf(report, case):
    _check_case(report[f"tiny-llama3/{case}"], report["tiny-llama3/pp1"])


def test_each_stage_holds_its_layers(report):
    pp2, pp2xtp2 = report["tiny-llama3/pp2"], report["tiny-llama3/pp2xtp2"]
    assert pp2["layer_devices"] == pp2["cache_devices"] == [[0], [1]]
    assert pp2["embed_devices"] == [0] and pp2["norm_devices"] == [1]
    assert pp2xtp2["layer_devices"] == pp2xtp2["cache_devices"] == [[0, 1], [2, 3]]


def test_unsupported_combinations_are_refused(report):
    refused = report["refused"]
    assert "does not support LoRA adapters (--enable-lora)" in refused["lora"]
    assert "multi-step decoding" in refused["multi_step"]
    assert "does not support speculative decoding (--speculative-config)" in refused["speculative"]
    assert "needs 8 devices, but only 4" in refused["devices"]


def test_layer_partition():
    from jaxserve.parallel.pipeline import layer_partition, stage_bounds

    assert layer_partition(30, 4, "") == [7, 8, 8, 7]     # vLLM's: the extra layers before the last stage
    assert layer_partition(7, 2, "") == [4, 3]
    assert layer_partition(8, 2, "") == [4, 4]
    assert layer_partition(30, 4, "10,10,5,5") == [10, 10, 5, 5]
    assert stage_bounds([4, 3]) == [(0, 4), (4, 7)]
    with pytest.raises(ValueError, match="add up to the model's 30 layers"):
        layer_partition(30, 4, "10,10,5")
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        layer_partition(2, 4, "")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny-llama3/pp2-no-queue", "tiny-qwen3moe/pp2xtp2", "tiny-gemma3/pp3",
                                  "tiny-gemma3/pp2xtp2"])
def test_pipeline_families_match_hf(slow_report, case):
    _check_case(slow_report[case], slow_report["tiny-llama3/pp1"] if case.startswith("tiny-llama3") else None)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_smollm2_pipeline_matches_transformers(slow_report, pp):
    smol = slow_report["smollm2"]
    assert smol[f"pp{pp}"] == smol["golden"]


_TWO_PROCESSES = """
import json, sys
from support.tiny_models import engine_with_preemption
llm, gold, outs = engine_with_preemption(sys.argv[1], pipeline_parallel_size=2, distributed_executor_backend="mp",
                                         skip_warmup=True)
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "golden": gold["greedy_ids"],
                  "preemptions": llm.engine.core.scheduler.num_preemptions}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3moe"])
def test_two_processes_pipeline_matches_hf(name):
    """PP=2 over two processes (``--distributed-executor-backend mp``: a spawned worker, ``jax.distributed``,
    one CPU device each): the stages hand on their hidden states with JAX's cross-host transfers."""
    from support.fake_devices import run_on_fake_devices

    out = run_on_fake_devices(["-c", _TWO_PROCESSES, name], 1, timeout=600)
    entry = json.loads(out.strip().splitlines()[-1])
    for i in (0, 2, 4):
        assert entry["tokens"][i] == entry["golden"]
    assert entry["preemptions"] > 0


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
