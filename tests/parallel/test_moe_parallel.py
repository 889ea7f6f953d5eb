"""Tensor and expert parallelism of the MoE families on 4 fake CPU devices: the prompt's logits equal one
device's (and HF's) and so do their greedy tokens, experts sharded the way each mode says (TP: each expert's intermediate columns; EP:
whole experts per device), and a split that cannot work refused with the sizes named.

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

NUM_DEVICES = 4
# (fixture, tensor_parallel_size, enable_expert_parallel): Qwen2-MoE has the shared expert and a dense layer
CASES = [("tiny-mixtral", 2, False), ("tiny-mixtral", 4, True), ("tiny-qwen2moe", 2, True),
         ("tiny-qwen3moe", 4, False)]
# the same on the GPU default's sort-free decode path (JAXSERVE_MOE_GROUPED_GEMM=rows, Pallas interpreted): a
# 16-token step takes it (TP needs intermediate / tp a multiple of 16, the kernel's smallest block)
ROWS_CASES = [("tiny-mixtral", 2, False), ("tiny-qwen3moe", 4, True)]
FIXTURES = os.path.join(support.FIXTURES, "models")


def _worker() -> dict:
    import jax
    import numpy as np

    from jaxserve import parallel
    from jaxserve.models import registry
    from jaxserve.models.loader import load_model
    from support.tiny_models import PagedRunner

    assert jax.device_count() == NUM_DEVICES, jax.devices()

    def run(name, mesh=None, ep=False):
        model = load_model(os.path.join(FIXTURES, name), dtype="float32", mesh=mesh, enable_expert_parallel=ep)
        with open(os.path.join(FIXTURES, name, "golden.json")) as f:
            prompt = json.load(f)["prompt_ids"]
        runner = PagedRunner(model, max_reqs=2, max_len=len(prompt), mesh=mesh)
        logits = runner.step([(0, prompt, 0)], 16, logits_rows=list(range(len(prompt))))
        return model, logits, logits.argmax(-1).tolist()

    report = {}
    single = {}
    for name in sorted({c[0] for c in CASES}):
        model, logits, tokens = run(name)
        single[name] = logits, tokens
        report[name] = {"hf_err": float(np.abs(logits - np.load(os.path.join(FIXTURES, name, "logits.npy"))).max())}
    for name, tp, ep in CASES:
        mesh = parallel.make_mesh(tp)
        model, logits, tokens = run(name, mesh, ep)
        layer0 = model.params["layers"][0]
        report[f"{name}/tp{tp}/ep{int(ep)}"] = {
            "err": float(np.abs(logits - single[name][0]).max()),
            "same_tokens": tokens == single[name][1],
            "gate_up_spec": str(layer0["experts_gate_up"].sharding.spec),
            "down_spec": str(layer0["experts_down"].sharding.spec),
            "local_gate_up": list(layer0["experts_gate_up"].addressable_shards[0].data.shape),
            "experts": model.config.extra_dict["num_experts"],
            "intermediate": model.config.extra_dict["moe_intermediate_size"]}
    families = {registry.resolve_architecture(a)[1] for a in ("MixtralForCausalLM", "Qwen3MoeForCausalLM")}
    for impl in ("rows", "rows_fused"):
        os.environ["JAXSERVE_MOE_GROUPED_GEMM"] = impl
        for family in families:               # specs are cached per config: the rows path from here on
            family.clear_caches()
        for name, tp, ep in ROWS_CASES:
            model, logits, tokens = run(name, parallel.make_mesh(tp), ep)
            assert model.family.decoder_spec(model.config).moe.rows_path_max_tokens > 0
            report[f"{impl}/{name}/tp{tp}/ep{int(ep)}"] = {"err": float(np.abs(logits - single[name][0]).max()),
                                                          "same_tokens": tokens == single[name][1]}
    del os.environ["JAXSERVE_MOE_GROUPED_GEMM"]
    for family in families:
        family.clear_caches()
    report["shared-layer"] = _shared_experts_layer(parallel.make_mesh(2))
    try:
        load_model(os.path.join(FIXTURES, "tiny-mixtral"), dtype="float32", mesh=parallel.make_mesh(3),
                   enable_expert_parallel=True)
    except ValueError as e:
        report["ep3"] = str(e)
    return report


def _shared_experts_layer(mesh) -> dict:
    """The MoE layer alone on the rows_fused path under ``mesh`` (the tiny checkpoints' experts are too narrow to
    split for the kernel): its output's largest difference from one device's and from the shared expert
    computed apart, over the real tokens; whether the padding tokens' rows are zero."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.models.layers import moe

    found, hidden, rng = {}, 64, np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((5, hidden)), jnp.float32)
    valid = np.asarray([True, False, True, True, False])
    for kind, gated in (("deepseek", False), ("qwen2", True)):
        # intermediate 32: 16 columns a device, the kernel's smallest block; shared 2 (3) experts wide
        spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=32, renormalize=False, layers=(True,),
                           grouped_gemm="pallas", rows_path_max_tokens=moe.ROWS_PATH_MAX_TOKENS, rows_fused=True,
                           router="softmax" if gated else "deepseek_v2", shared_expert_gate=gated,
                           shared_intermediate_size=(3 if gated else 2) * 32)
        layer = type("Layer", (), {})()
        moe.declare_params(layer, hidden, spec, lambda shape, sharding, *_: (shape, sharding))
        w = {name: (jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32), sharding)
             for name, (shape, sharding) in vars(layer).items()}
        placed = {name: jax.device_put(a, NamedSharding(mesh, P(*sharding))) for name, (a, sharding) in w.items()}
        w = {name: a for name, (a, _) in w.items()}
        mlp = jax.jit(lambda h, w, spec: moe.moe_mlp(h, w, spec, jax.nn.silu, jnp.asarray(valid))[0],
                      static_argnums=2)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out = np.asarray(mlp(h, placed, spec))
        one, apart = (np.asarray(mlp(h, w, s)) for s in (spec, dataclasses.replace(spec, rows_fused=False)))
        found[kind] = {"err": float(np.abs(out - one)[valid].max()),
                       "apart_err": float(np.abs(out - apart)[valid].max()), "padding_zero": not out[~valid].any()}
    return found


@pytest.fixture(scope="module")
def report():
    return fake_device_report([__file__], NUM_DEVICES)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-tp{t}-{'ep' if e else 'tp'}" for n, t, e in CASES])
def test_parallel_logits_equal_one_device(report, case):
    name, tp, ep = case
    entry = report[f"{name}/tp{tp}/ep{int(ep)}"]
    assert report[name]["hf_err"] <= 1e-4
    assert entry["err"] <= 1e-5 and entry["same_tokens"], entry
    if ep:     # whole experts: E / tp per device, each with all its intermediate columns
        assert entry["gate_up_spec"].startswith("P('tp'"), entry
        assert entry["local_gate_up"] == [entry["experts"] // tp, 64, 2, entry["intermediate"]], entry
    else:      # every expert on every device, its intermediate columns split
        assert entry["gate_up_spec"] == "P(None, None, None, 'tp')", entry
        assert entry["local_gate_up"] == [entry["experts"], 64, 2, entry["intermediate"] // tp], entry


@pytest.mark.parametrize("impl", ["rows", "rows_fused"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=[f"{n}-tp{t}-{'ep' if e else 'tp'}" for n, t, e in ROWS_CASES])
def test_rows_path_parallel_logits_equal_one_device(report, case, impl):
    name, tp, ep = case
    entry = report[f"{impl}/{name}/tp{tp}/ep{int(ep)}"]
    assert entry["err"] <= 1e-5 and entry["same_tokens"], entry


@pytest.mark.parametrize("kind", ["deepseek", "qwen2"])
def test_shared_experts_ride_along_under_tensor_parallelism(report, kind):
    """The rows_fused layer at tp = 2: each device computes its part of the shared MLP as experts of its part
    of the routed experts' width, in their launches, and the one all-reduce sums both."""
    entry = report["shared-layer"][kind]
    assert entry["err"] <= 1e-5 and entry["apart_err"] <= 1e-5 and entry["padding_zero"], entry


def test_expert_parallel_split_must_divide_the_experts(report):
    assert "8 experts are not divisible by 3 (expert parallel)" in report["ep3"]


if __name__ == "__main__":
    sys.path.insert(0, support.TESTS)
    print(json.dumps(_worker()))
