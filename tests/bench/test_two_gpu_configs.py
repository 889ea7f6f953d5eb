"""The two-H200 measurements without the GPUs: the 70B / 32B model shapes are the published ones; the h200x2-*
benchmark configs load, their rooflines compute and what each GPU must hold fits; the h200x2 suite runs each of
them on two GPUs (skipped, and said, on fewer); and Llama-3.1-70B's random weights build sharded over two devices — each
device generates its own half of every weight (the compiled generators hold nothing of a whole weight), the
halves add up to 70.5 GB a GPU, a scaled-down copy loads sharded through the dummy loader with no host copy,
and fp8 random weights are quantized one at a time (the 141 GB bf16 copy never exists).

Fake devices need ``XLA_FLAGS`` before JAX starts, so the sharding checks run once in a subprocess (this file
as a script) that prints its findings as JSON."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

from jaxserve.benchmarks import config as bcfg
from jaxserve.benchmarks import roofline
from support import xla_flags
from jaxserve.benchmarks.models import resolve_model

MODELS = ROOT / "configs" / "models"
# the two-GPU configs and the 70B in fp8 on one GPU (h200x2-llama8b-tp2 is the 8B's TP=2 batch 1)
X2_CONFIGS = [f"h200x2-llama70b-tp2-{m}" for m in ("latency-bs1", "throughput", "serve")] + \
    [f"h200x2-mixtral-8x7b-{split}-{m}" for split in ("ep2", "tp2") for m in ("latency-bs1", "throughput")] + \
    ["h200x2-qwen3-32b-tp2-throughput", "h200-llama70b-fp8-latency-bs1"]
H200 = roofline.load_hardware("h200")[0]
# what the engine's KV cache may take on one H200 (runner.kv_cache.num_blocks): gpu_memory_utilization 0.9 of
# JAX's default 75 % of the 143,771 MiB nvidia-smi reports, less the weights and the activation reserve
H200_ENGINE_BYTES = 0.9 * 0.75 * 143771 * 2 ** 20


def _hf(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def _scaled_70b() -> dict:
    """Llama-3.1-70B's config with its head counts, a narrow width and two layers: the same split, small."""
    return _hf("llama-3.1-70b") | {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 2,
                                   "vocab_size": 16032}


# ------------------------------------------------------------------------------------------- model shapes
@pytest.mark.parametrize("name, params, shape", [
    ("llama-3.1-70b", 70_553_706_496, dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                           num_key_value_heads=8, intermediate_size=28672, vocab_size=128256)),
    ("qwen3-32b", 32_762_123_264, dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                                       num_key_value_heads=8, intermediate_size=25600, vocab_size=151936,
                                       head_dim=128)),
])
def test_model_configs_are_the_published_shapes(name, params, shape):
    from jaxserve.models.configs import model_config_from_hf
    hf = _hf(name)
    assert {k: hf[k] for k in shape} == shape
    assert roofline.model_cost(model_config_from_hf(hf)).params == params


def test_llama70b_rope_is_llama3_scaled_like_8b():
    assert _hf("llama-3.1-70b")["rope_scaling"] == _hf("llama-3.1-8b")["rope_scaling"]
    assert _hf("llama-3.1-70b")["rope_scaling"]["rope_type"] == "llama3"


# ----------------------------------------------------------------------------------------------- configs
def _cost(cfg: dict):
    mc, _ = resolve_model(cfg)
    e = cfg["engine"]
    return mc, roofline.model_cost(mc, "bfloat16", quantization=e.get("quantization"))


def _per_device_need(cfg: dict) -> float:
    """Bytes one GPU holds for the config: its share of the weights (norms counted once per device: small),
    the KV cache of max_num_seqs sequences at the workload's longest length, and the engine's activation
    reserve."""
    mc, cost = _cost(cfg)
    e, wl = cfg["engine"], cfg["workload"]
    tp = int(e.get("tensor_parallel_size") or 1)
    # weight_bytes leaves out an untied embedding table (a step gathers rows of it); the GPU holds it (bf16)
    weights = cost.weight_bytes + (0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size * 2)
    seqs = int(wl.get("batch_size") or 0) if cfg["mode"] == "latency" else int(e["max_num_seqs"])
    if cfg["mode"] == "serve":
        seqs = min(int(e["max_num_seqs"]), max(wl["sweep"]["max_concurrency"]))
    tokens = -(-(wl["input_len"] + wl["output_len"]) // 16) * 16          # whole blocks of 16
    kv = cost.kv_bytes_per_token / min(tp, mc.num_kv_heads) * tokens * seqs
    act = 64 * e["max_num_batched_tokens"] * max(mc.hidden_size, mc.intermediate_size) \
        + 8 * e["max_num_seqs"] * mc.vocab_size
    return weights / tp + kv + act


@pytest.mark.parametrize("name", X2_CONFIGS)
def test_x2_configs_validate_and_fit_each_gpu(name):
    cfg = bcfg.load_config(name)
    assert cfg["name"] == name and cfg["hardware"] == "h200" and cfg["model"]["load_format"] == "dummy"
    assert cfg["baseline"]["hf"] is False                  # no HF baseline holds a 70B model on the GPU host
    need = _per_device_need(cfg)
    assert need < H200_ENGINE_BYTES, f"{name}: {need / 1e9:.1f} GB a GPU, {H200_ENGINE_BYTES / 1e9:.1f} available"
    buckets = cfg["engine"]["token_buckets"]
    assert buckets == sorted(buckets) and buckets[-1] == cfg["engine"]["max_num_batched_tokens"]


def test_llama70b_tp2_rooflines():
    """Batch 1: the 139 GB weight stream over both chips' read ceiling (~66 tok/s, twice one chip's); offline:
    prefill-bound; fp8 on one chip has about the same batch-1 limit as bf16 on two."""
    lat = bcfg.load_config("h200x2-llama70b-tp2-latency-bs1")
    _, cost = _cost(lat)
    wl = lat["workload"]
    two = H200.scaled(lat["engine"]["tensor_parallel_size"])
    t = roofline.decode_steps_bound(cost, two, 1, wl["input_len"], wl["output_len"])
    assert cost.weight_bytes / 1e9 == pytest.approx(139.0, abs=0.1)
    assert wl["output_len"] / t == pytest.approx(66.1, abs=0.3)
    assert roofline.decode_steps_bound(cost, H200, 1, wl["input_len"], wl["output_len"]) == pytest.approx(2 * t)

    thr = bcfg.load_config("h200x2-llama70b-tp2-throughput")
    w = thr["workload"]
    assert (w["num_prompts"], w["input_len"], w["output_len"]) == (1000, 1024, 128)
    b = roofline.generation_bound(cost, two, w["num_prompts"], w["input_len"], w["output_len"],
                                  thr["engine"]["max_num_seqs"])
    assert b["prefill_seconds"] > b["decode_seconds"] and 1000 < b["output_tok_s"] < 1300

    fp8 = bcfg.load_config("h200-llama70b-fp8-latency-bs1")
    assert fp8["engine"]["quantization"] == "fp8" and fp8["engine"].get("tensor_parallel_size", 1) == 1
    _, c8 = _cost(fp8)
    t8 = roofline.decode_steps_bound(c8, H200, 1, wl["input_len"], wl["output_len"])
    assert c8.weight_bytes < 0.53 * cost.weight_bytes and t8 == pytest.approx(t, rel=0.05)


def test_configs_that_share_an_engine_have_one_engine_section():
    """The runner reuses one engine for configs whose engine sections match (one load and compile), and the serve
    config's server finds the offline run's programs in the compile cache; TP=1 and TP=2 differ only in the split."""
    engine = lambda n: bcfg.load_config(n)["engine"]  # noqa: E731
    seventy = [engine(f"h200x2-llama70b-tp2-{m}") for m in ("latency-bs1", "throughput", "serve")]
    assert seventy[0] == seventy[1] == seventy[2]
    assert seventy[0]["tensor_parallel_size"] == 2 and seventy[0]["distributed_executor_backend"] == "mp"
    for split, ep in (("ep2", True), ("tp2", False)):
        a, b = engine(f"h200x2-mixtral-8x7b-{split}-latency-bs1"), engine(f"h200x2-mixtral-8x7b-{split}-throughput")
        assert a == b and a["enable_expert_parallel"] is ep and a["tensor_parallel_size"] == 2
    ep2, tp2 = engine("h200x2-mixtral-8x7b-ep2-throughput"), engine("h200x2-mixtral-8x7b-tp2-throughput")
    assert {k: v for k, v in ep2.items() if k != "enable_expert_parallel"} == \
        {k: v for k, v in tp2.items() if k != "enable_expert_parallel"}
    one = bcfg.load_config("h200x2-qwen3-32b-tp2-throughput", ["engine.tensor_parallel_size=1",
                                                               "engine.distributed_executor_backend=uni"])
    two = bcfg.load_config("h200x2-qwen3-32b-tp2-throughput")
    assert one["workload"] == two["workload"] and two["engine"]["tensor_parallel_size"] == 2
    assert _per_device_need(one) < H200_ENGINE_BYTES            # TP=1 fits one H200 with the same batch


def test_serve_config_starts_the_server_tensor_parallel():
    flags = bcfg.server_flags(bcfg.load_config("h200x2-llama70b-tp2-serve"))
    assert flags[0] == "llama-3.1-70b"
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert flags[flags.index("--distributed-executor-backend") + 1] == "mp"
    assert flags[flags.index("--token-buckets") + 1:][:3] == ["4", "128", "2048"]


# ------------------------------------------------------------------------------------------- the h200x2 suite
def test_h200x2_suite_runs_every_x2_config_on_two_gpus():
    from jaxserve.benchmarks import suites
    runs = suites.load_suite("h200x2")["runs"]
    assert set(X2_CONFIGS) <= {c for r in runs for c in r["configs"]}
    for r in runs:
        tp = {bcfg.load_config(c, r["set"])["engine"].get("tensor_parallel_size", 1) for c in r["configs"]}
        ep = {bcfg.load_config(c, r["set"])["engine"].get("enable_expert_parallel", False) for c in r["configs"]}
        two = tp == {2} or ep == {True}
        assert (r["gpus"] == 2) == two, r
        assert r["env"].get("NCCL_NVLS_ENABLE") == ("0" if two else None)        # NVLink multicast off
        assert two or r["env"]["CUDA_VISIBLE_DEVICES"] == "0"


def test_h200x2_suite_skips_its_two_gpu_runs_without_them(monkeypatch, capsys):
    from jaxserve.benchmarks import suites
    ran = []
    monkeypatch.setattr(suites, "visible_gpus", lambda: 1)
    monkeypatch.setattr(suites, "run_once", lambda cmd, *_: ran.append(cmd) or (0, []))
    assert suites.run_suite("h200x2", [], None) == 0
    assert [c[c.index("--config") + 1] for c in ran] == ["h200x2-qwen3-32b-tp2-throughput", "h200-llama70b-fp8-latency-bs1"]
    assert capsys.readouterr().out.count("skipped, needs 2 GPUs (1 visible)") == 6


# ------------------------------------------------------------------------------- fp8 random weights, 1 device
def test_fp8_random_weights_are_quantized_as_they_are_made(tmp_path, monkeypatch):
    """At every quantization, the projection being quantized is the only float projection alive."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import loader, packaged
    from jaxserve.quantization import loading as quant_loading
    from jaxserve.quantization.weights import Fp8Weight

    (tmp_path / "scaled-70b.json").write_text(json.dumps(_scaled_70b()))
    monkeypatch.setattr(packaged, "DUMMY_CONFIG_DIR", tmp_path)
    cfg_shapes = {(1024, 1280), (1024, 1024), (1024, 2, 3584), (3584, 1024)}   # qkv (fused), o, gate_up, down
    alive, quantize = [], quant_loading.quantize_leaf

    def counting(q, path, w, sharding, scale_dtype):
        alive.append(sum(1 for a in jax.live_arrays() if a.dtype == jnp.bfloat16 and tuple(a.shape) in cfg_shapes))
        return quantize(q, path, w, sharding, scale_dtype)

    monkeypatch.setattr(quant_loading, "quantize_leaf", counting)
    model = loader.load_model("scaled-70b", load_format="dummy", dtype="bfloat16", quantization="fp8")
    assert len(alive) == 2 * 4 and max(alive) == 1, alive
    assert all(isinstance(model.params["layers"][1][n], Fp8Weight) for n in ("qkv", "o", "gate_up", "down"))


# ------------------------------------------------------------------------------------ TP=2, 2 fake devices
def _worker() -> dict:
    import tracemalloc

    import jax
    import jax.numpy as jnp

    from jaxserve import parallel
    from jaxserve.models import dummy_loader, loader, packaged, registry
    from jaxserve.models.configs import model_config_from_hf
    from jaxserve.models.layers.decoder import _is_shape
    from jaxserve.models.layers.dummy_init import dummy_init_fn as _dummy_init_fn, leaf_seed as _leaf_seed

    assert jax.device_count() == 2
    mesh = parallel.make_mesh(2)
    report = {}

    # the full-size 70B, never allocated: each distinct weight's compiled generator, per device
    hf = _hf("llama-3.1-70b")
    cfg = model_config_from_hf(hf)
    _, family = registry.resolve_architecture(hf["architectures"])
    shapes = jax.tree.leaves(family.param_shapes(cfg), is_leaf=_is_shape)
    shardings = jax.tree.leaves(parallel.param_shardings(family.param_partition_specs(cfg), mesh, cfg))
    inits = jax.tree.leaves(family.param_inits(cfg))
    per_device = sum(int(np.prod(s.shard_shape(shape))) * 2 for shape, s in zip(shapes, shardings))
    report["per_device_bytes"], report["total_bytes"] = per_device, sum(int(np.prod(s)) * 2 for s in shapes)
    generators = {}
    for shape, kind, sharding in zip(shapes, inits, shardings):
        if (kind, shape, sharding) in generators or kind != "normal":
            continue
        text = _dummy_init_fn(kind, shape, jnp.dtype("bfloat16"), sharding).lower(_leaf_seed(0, 0)).compile().as_text()
        largest = max(int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"\w+\[([\d,]+)\]", text))
        generators[(kind, shape, sharding)] = {"shape": list(shape), "elements": int(np.prod(shape)),
                                               "shard": int(np.prod(sharding.shard_shape(shape))),
                                               "largest_array": largest}
    report["generators"] = list(generators.values())

    # a scaled-down 70B through the dummy loader: every weight sharded as declared, no host copy of any
    tmp = tempfile.mkdtemp()
    Path(tmp, "scaled-70b.json").write_text(json.dumps(_scaled_70b()))
    packaged.DUMMY_CONFIG_DIR = Path(tmp)
    model = loader.load_model("scaled-70b", load_format="dummy", dtype="bfloat16", mesh=mesh)
    # the weights again, as load_dummy builds them, with Python's allocations (numpy's included) traced: the
    # tokenizer and imports above are not the weights' business
    tracemalloc.start()
    rebuilt = dummy_loader.dummy_params(model.config, family, jnp.bfloat16, 1, mesh, None)
    jax.block_until_ready(jax.tree.leaves(rebuilt))
    host_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del rebuilt
    want = jax.tree.leaves(parallel.param_shardings(family.param_partition_specs(model.config), mesh, model.config))
    leaves = jax.tree.leaves(model.params)
    report["scaled"] = {
        "bytes": sum(a.nbytes for a in leaves), "host_peak_bytes": host_peak,
        "as_declared": all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(leaves, want)),
        "split": sum(1 for a in leaves if len({sh.index for sh in a.addressable_shards}) == 2),
        "leaves": len(leaves),
        "device_bytes": [sum(sh.data.nbytes for a in leaves for sh in a.addressable_shards if sh.device == d)
                         for d in mesh.devices.flat]}
    fp8 = loader.load_model("scaled-70b", load_format="dummy", dtype="bfloat16", mesh=mesh, quantization="fp8")
    layer = fp8.params["layers"][0]
    report["fp8_split"] = {n: len({sh.index for sh in layer[n].weight.addressable_shards}) == 2
                           for n in ("q", "k", "v", "o", "gate_up", "down")}
    return report


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # one fake-device subprocess compiles every full-size 70B generator (~80 s)
def test_llama70b_tp2_puts_half_of_the_weights_on_each_gpu(report):
    assert report["total_bytes"] == 2 * 70_553_706_496
    norms = 2 * (2 * 80 + 1) * 8192                              # replicated: on both devices
    assert report["per_device_bytes"] == (report["total_bytes"] - norms) // 2 + norms
    assert report["per_device_bytes"] / 1e9 == pytest.approx(70.56, abs=0.01)


@pytest.mark.slow   # one fake-device subprocess compiles every full-size 70B generator (~80 s)
def test_each_device_generates_only_its_half_of_a_weight(report):
    """The compiled random-weight generator of every full-size 70B weight: no array of the per-device program is
    larger than the device's shard (the whole weight is never materialized on one device)."""
    assert len(report["generators"]) >= 6
    for g in report["generators"]:
        assert g["shard"] * 2 == g["elements"], g                # every matrix is split, none replicated
        assert g["largest_array"] == g["shard"], g


@pytest.mark.slow   # one fake-device subprocess compiles every full-size 70B generator (~80 s)
def test_scaled_70b_loads_sharded_without_a_host_copy(report):
    s = report["scaled"]
    assert s["as_declared"] and s["leaves"] == 2 * 8 + 3        # 2 layers x (2 norms + 6 matrices), embed, norm, head
    assert s["split"] == s["leaves"] - (2 * 2 + 1)               # all but the norms
    assert s["device_bytes"][0] == s["device_bytes"][1] < 0.51 * s["bytes"]
    assert s["host_peak_bytes"] < 0.05 * s["bytes"], s          # numpy never holds the weights


@pytest.mark.slow   # one fake-device subprocess compiles every full-size 70B generator (~80 s)
def test_scaled_70b_fp8_weights_are_sharded(report):
    assert all(report["fp8_split"].values()), report["fp8_split"]


if __name__ == "__main__":
    print(json.dumps(_worker()))
