"""DeepSeek under tensor parallelism (TP=2: heads split, the latent cache replicated) and expert parallelism
(EP=2: whole routed experts per device) on 2 fake CPU devices: the prompt's logits equal one device's (and HF's)
and so do HF's greedy tokens decoded through the paged latent cache; the cache and the MLA weights placed as
``layers.mla`` says.

Fake devices need ``XLA_FLAGS`` before JAX starts, so the checks run once in a subprocess (this file as a
script) that prints its findings as JSON.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

import support
from support.fake_devices import fake_device_report

pytestmark = pytest.mark.slow     # fake-device TP/EP runs: make test-slow

NUM_DEVICES = 2
CASES = [("tiny-deepseek-v2", False), ("tiny-deepseek-v2", True), ("tiny-deepseek-v2-lite", False),
         ("tiny-deepseek-v3", True)]
FIXTURES = os.path.join(support.FIXTURES, "models")


def _worker() -> dict:
    import jax
    import numpy as np

    from jaxserve import parallel
    from jaxserve.models.loader import load_model
    from support.tiny_models import PagedRunner

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    report = {}
    for name, ep in CASES:
        with open(os.path.join(FIXTURES, name, "golden.json")) as f:
            golden = json.load(f)
        prompt, expected = golden["prompt_ids"], golden["greedy_ids"]
        mesh = parallel.make_mesh(NUM_DEVICES)
        model = load_model(os.path.join(FIXTURES, name), dtype="float32", mesh=mesh, enable_expert_parallel=ep)
        runner = PagedRunner(model, max_reqs=2, max_len=len(prompt) + len(expected), mesh=mesh)
        logits = runner.step([(0, prompt, 0)], 16, logits_rows=list(range(len(prompt))))
        greedy = PagedRunner(model, max_reqs=2, max_len=len(prompt) + len(expected), mesh=mesh, seed=1).greedy(
            [prompt, prompt], len(expected), prefill_tokens=24)
        layer1 = model.params["layers"][1]
        report[f"{name}/ep{int(ep)}"] = {
            "hf_err": float(np.abs(logits - np.load(os.path.join(FIXTURES, name, "logits.npy"))).max()),
            "greedy": greedy == [expected, expected],
            "cache_spec": str(runner.kv_caches[0][0].sharding.spec),
            "local_cache": list(runner.kv_caches[0][0].addressable_shards[0].data.shape),
            "cache": list(runner.kv_caches[0][0].shape),
            "uk_local": list(layer1["uk"].addressable_shards[0].data.shape), "uk": list(layer1["uk"].shape),
            "kv_a_spec": str(layer1.get("fused_qkv_a", layer1.get("kv_a")).sharding.spec),   # replicated
            "experts_local": layer1["experts_down"].addressable_shards[0].data.shape[0],
            "experts": layer1["experts_down"].shape[0]}
    return report


@pytest.fixture(scope="module")
def report():
    return fake_device_report([__file__], NUM_DEVICES)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{'ep' if e else 'tp'}2" for n, e in CASES])
def test_deepseek_parallel_matches_hf(report, case):
    name, ep = case
    entry = report[f"{name}/ep{int(ep)}"]
    assert entry["hf_err"] <= 1e-4 and entry["greedy"], entry
    assert entry["cache_spec"] == "P()" and entry["local_cache"] == entry["cache"], entry  # replicated
    assert entry["uk_local"] == [entry["uk"][0] // NUM_DEVICES, *entry["uk"][1:]], entry         # heads split
    assert entry["kv_a_spec"] == "P()", entry
    assert entry["experts_local"] == (entry["experts"] // NUM_DEVICES if ep else entry["experts"]), entry


if __name__ == "__main__":
    sys.path.insert(0, support.TESTS)
    print(json.dumps(_worker()))
