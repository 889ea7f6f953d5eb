"""Draft heads under tensor parallelism, on 2 fake CPU devices: with an EAGLE head, an EAGLE-3 head (its own
embedding and a draft vocabulary of 200 of the 256 tokens) and DeepSeek's MTP layer (MLA, MoE; also with expert
parallelism), greedy output at TP=2 equals TP=1 without speculation, and the head proposes at TP=2 the drafts
it proposes at TP=1. The head runs on the target's mesh: its weights sharded over "tp" as the target's layers
(its experts as the target's), reading the target's (replicated) hidden states.

As in test_speculative_parallel, the checks run in a subprocess (this file run as a script) that prints its
findings as JSON.
"""
from __future__ import annotations

import json
import pathlib
import tempfile

import numpy as np
import pytest

from support.fake_devices import fake_device_report

pytestmark = pytest.mark.slow     # fake-device TP runs of three heads (~75 s): make test-slow

NUM_DEVICES = 2
PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [1, 2, 3], list(range(30, 70)), [200, 11, 11, 11, 64, 9],
           [5, 6, 7, 8] * 5, list(range(10, 30)) * 2]
# each method at TP=2, and DeepSeek's MTP layer with expert parallelism (its experts whole on each device)
RUNS = ("eagle/tp2", "eagle3/tp2", "deepseek_mtp/tp2", "deepseek_mtp/ep2")


# ------------------------------------------------------------------------------------------ the subprocess
def _worker() -> dict:
    import jax

    from support.speculation import (greedy, make_eagle3_head, make_eagle_head, record_drafts,
                                     token_ids, with_mtp_layer)
    from support.tiny_models import fixture_path, tiny_llm

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    root = pathlib.Path(tempfile.mkdtemp())
    subset = np.random.default_rng(5).permutation(256)[:200]
    llama, deepseek = fixture_path("tiny-llama3"), with_mtp_layer(root / "deepseek")
    cases = {"eagle": (llama, {"model": make_eagle_head(root / "eagle", bias=True)}),
             "eagle3": (llama, {"model": make_eagle3_head(root / "eagle3", draft_ids=subset, embed=True)}),
             "deepseek_mtp": (deepseek, {})}
    opts = dict(max_model_len=128, max_num_seqs=4, skip_warmup=True)
    report = {}
    for target in (llama, deepseek):
        report[target] = token_ids(tiny_llm(target, **opts).generate(PROMPTS, greedy(16), use_tqdm=False))
    runs = [(method, tp, {}) for method in cases for tp in (1, 2)]
    runs.append(("deepseek_mtp", 2, {"enable_expert_parallel": True}))
    for method, tp, kw in runs:
        target, spec = cases[method]
        llm = tiny_llm(target, tensor_parallel_size=tp, **opts, **kw,
                       speculative_config={"method": method, "num_speculative_tokens": 3, **spec})
        core = llm.engine.core
        drafts = record_drafts(llm)
        tokens = token_ids(llm.generate(PROMPTS, greedy(16), use_tqdm=False))
        head = core.speculator.draft
        report[f"{method}/{'ep' if kw else 'tp'}{tp}"] = {
            "same_as_plain": tokens == report[target], "drafts": drafts,
            "drafted": core.stats()["spec_decode_num_draft_tokens"],
            "sharded": sorted(jax.tree_util.keystr(path, simple=True, separator=".") for path, w in
                              jax.tree_util.tree_leaves_with_path(head.model.params["layers"][0])
                              if "tp" in str(getattr(w.sharding, "spec", ""))),
            "experts_spec": str(getattr(head.model.params["layers"][0]["experts_down"].sharding, "spec", None))
            if method == "deepseek_mtp" else None,
            "head_mesh_is_target's": head.runner.mesh is core.runner.mesh}
        del llm, core, head
    return report


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def report():
    return fake_device_report([__file__], NUM_DEVICES, timeout=900)


@pytest.mark.parametrize("run", RUNS)
def test_greedy_output_at_tp2_matches_tp1_without_speculation(report, run):
    method = run.split("/")[0]
    assert report[f"{method}/tp1"]["same_as_plain"] and report[run]["same_as_plain"]
    assert report[run]["drafted"] > 0


@pytest.mark.parametrize("run", RUNS)
def test_the_head_drafts_at_tp2_what_it_drafts_at_tp1(report, run):
    assert report[run]["drafts"] == report[run.split("/")[0] + "/tp1"]["drafts"]
    assert len(report[run]["drafts"]) > 5


@pytest.mark.parametrize("run", RUNS)
def test_the_head_is_sharded_on_the_target_mesh(report, run):
    r = report[run]
    assert r["head_mesh_is_target's"]
    assert {"o", "down"} <= set(r["sharded"]) or {"o", "shared_down"} <= set(r["sharded"]), r["sharded"]
    if run.startswith("deepseek_mtp"):      # tensor parallel: each expert's columns; expert parallel: whole ones
        assert r["experts_spec"] == ("P('tp', None, None)" if run.endswith("ep2") else "P(None, 'tp', None)")


if __name__ == "__main__":
    print(json.dumps(_worker()))
