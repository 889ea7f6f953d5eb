"""Speculative decoding under tensor parallelism, on 2 fake CPU devices: greedy output with n-gram and with
draft-model speculation at TP=2 (n-gram also proposed on the device, under async scheduling) equals TP=1
without speculation on the tiny Llama, with rejections (the n-gram
lookup, another draft model) and with every draft accepted (the draft set to the target). The draft model runs
on the target's mesh: its weights and KV cache are sharded over "tp" like the target's. With the warm-up on,
speculative steps run the executables compiled ahead (none compiles on the way).

As in test_tensor_parallel, the checks run in a subprocess (this file run as a script) that prints its
findings as JSON.
"""
from __future__ import annotations

import json
import os

import pytest

import support
from support.fake_devices import fake_device_report

NUM_DEVICES = 2
FIXTURES = os.path.join(support.FIXTURES, "models")
PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [1, 2, 3], list(range(30, 70)), [200, 11, 11, 11, 64, 9],
           [5, 6, 7, 8] * 5, list(range(10, 30)) * 2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _draft(name: str, k: int) -> dict:
    return {"method": "draft_model", "model": os.path.join(FIXTURES, name), "num_speculative_tokens": k}


CASES = {"plain/tp1": (1, None), "ngram/tp2": (2, NGRAM), "ngram-device/tp2": (2, NGRAM),
         "draft/tp2": (2, _draft("tiny-llama-tied", 2)), "draft-is-target/tp2": (2, _draft("tiny-llama3", 3))}


# ------------------------------------------------------------------------------------------ the subprocess
def _worker() -> dict:
    import jax

    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    report = {}
    for name, (tp, spec) in CASES.items():
        # the n-gram engines warm up (a few buckets): their steps must run what the warm-up compiled; the
        # device one proposes on the device under async scheduling (``runner.ngram_device``)
        warm = name.startswith("ngram")
        os.environ["JAXSERVE_SPEC_ASYNC"] = "1" if name == "ngram-device/tp2" else "0"
        llm = LLM(os.path.join(FIXTURES, "tiny-llama3"), tensor_parallel_size=tp, dtype="float32",
                  max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory_bytes=1 << 22,
                  token_buckets=[16, 64] if warm else None, skip_warmup=not warm, compilation_cache_dir="",
                  use_tqdm_on_load=False, speculative_config=spec)
        core = llm.engine.core
        ngram = core.runner.ngram
        compiles = (lambda: len(ngram.executables)) if ngram else (lambda: 0)
        if warm:
            core.wait_compiled()
            before = core.runner.compiled_variants() + compiles()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        entry = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
        if spec is not None:
            stats = core.stats()
            entry["drafted"] = stats["spec_decode_num_draft_tokens"]
            entry["accepted"] = stats["spec_decode_num_accepted_tokens"]
            entry["on_device"] = core.runner.ngram is not None
            draft = core.speculator.draft
            if draft is not None:
                entry["draft_k_spec"] = str(draft.model.params["layers"][0]["k"].sharding.spec)
                entry["draft_mesh_is_target's"] = draft.runner.mesh is core.runner.mesh
        if warm:
            entry["new_variants"] = core.runner.compiled_variants() + compiles() - before
        report[name] = entry
        del llm, core, ngram
    return report


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def report():
    return fake_device_report([__file__], NUM_DEVICES, timeout=600)


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain/tp1"])
def test_greedy_speculation_at_tp2_matches_tp1_without_it(report, case):
    assert report[case]["tokens"] == report["plain/tp1"]["tokens"]
    assert report[case]["drafted"] > 0


def test_rejections_and_acceptances_both_happen(report):
    for case in ("ngram/tp2", "ngram-device/tp2"):
        assert 0 < report[case]["accepted"] < report[case]["drafted"]
    assert report["ngram-device/tp2"]["on_device"] and not report["ngram/tp2"]["on_device"]
    assert report["draft/tp2"]["accepted"] < report["draft/tp2"]["drafted"]
    assert report["draft-is-target/tp2"]["accepted"] == report["draft-is-target/tp2"]["drafted"]


def test_the_draft_model_is_sharded_on_the_target_mesh(report):
    for case in ("draft/tp2", "draft-is-target/tp2"):
        assert report[case]["draft_mesh_is_target's"]
        assert report[case]["draft_k_spec"] == "P(None, 'tp')"


def test_speculative_steps_run_the_executables_compiled_ahead(report):
    assert report["ngram/tp2"]["new_variants"] == 0
    assert report["ngram-device/tp2"]["new_variants"] == 0


if __name__ == "__main__":
    print(json.dumps(_worker()))
