"""The DeepSeek family (V2 with q LoRA and group-limited routing, V2-Lite without q LoRA and with YaRN, V3 with
sigmoid + bias node-limited routing) against HF transformers float32, on the tiny random checkpoints of
tests/make_deepseek_fixtures.py: the prompt's logits within 1e-4 through the paged latent cache, prefill in two
chunks, HF's 32-token greedy continuation decoded twice in one batch, and through the engine with prefix caching,
chunked prefill and preemption; the config's two RoPE spellings; the latent cache's layout and size.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxserve.models.layers import moe
from jaxserve.models.loader import load_model
from support.tiny_models import (FIXTURES, check_chunked_prefill_matches_hf, check_greedy_matches_hf, check_logits_match_hf,
                         check_orbax_round_trip, engine_with_preemption, golden, load_tiny)

DEEPSEEK = ["tiny-deepseek-v2", "tiny-deepseek-v2-lite", "tiny-deepseek-v3"]


@pytest.fixture(scope="module", params=DEEPSEEK)
def tiny(request):
    return load_tiny(request.param)


def test_deepseek_logits_match_hf(tiny):
    check_logits_match_hf(*tiny)


def test_deepseek_chunked_prefill_matches_hf(tiny):
    check_chunked_prefill_matches_hf(*tiny)


def test_deepseek_greedy_matches_hf(tiny):
    check_greedy_matches_hf(*tiny)


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_fused_rows_path_matches_hf(name, monkeypatch):
    """``JAXSERVE_MOE_GROUPED_GEMM=rows_fused`` (the kernels interpreted here): decode steps route through
    ``kernels.moe_route.grouped_top_k`` (V2's group-limited softmax, V2-Lite's greedy, V3's sigmoid + bias
    node-limited top-k) and the one-launch rows products, the shared experts in the same launches; HF's greedy
    continuation decoded twice in one batch."""
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", "rows_fused")
    monkeypatch.setenv("JAXSERVE_MOE_SHARED_IN_ROWS", "1")
    model = load_model(os.path.join(FIXTURES, name), dtype="float32")
    model.family.clear_caches()          # specs are cached per config: forget the other runs'
    try:
        spec = model.family.decoder_spec(model.config).moe
        assert spec.rows_fused and moe._shared_rides_along(1, model.params["layers"][1], spec)     # layer 0: dense
        check_greedy_matches_hf(name, model, golden(name))
    finally:
        model.family.clear_caches()


def test_deepseek_reads_its_config(tiny):
    """MLA and routing as each checkpoint says; the cache is one latent row of kv_lora_rank + rope dims."""
    name, model, _, _ = tiny
    cfg, family = model.config, model.family
    spec = family.decoder_spec(cfg)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 32 + 8)
    assert family.kv_cache_shapes(cfg, 7, 4, np.float32) == ((7, 4, 40),)
    assert spec.moe.layers == (False, True, True) and spec.moe.shared_expert_gate is False
    expected = {"tiny-deepseek-v2": ("deepseek_v2", 4, 2, 1.5, 32), "tiny-deepseek-v2-lite": ("deepseek_v2", 1, 1, 1.0, None),
                "tiny-deepseek-v3": ("deepseek_v3", 4, 2, 2.5, 32)}[name]
    assert (spec.moe.router, spec.moe.num_groups, spec.moe.topk_groups, spec.moe.routed_scaling_factor,
            spec.mla.q_lora_rank) == expected
    layer1 = model.params["layers"][1]
    assert layer1["experts_gate_up"].shape == (spec.moe.num_experts, 64, 2, 16)
    assert ("router_bias" in layer1) == (name == "tiny-deepseek-v3")
    # with a q LoRA, q_a_proj and kv_a_proj_with_mqa load as one weight (one GEMM a layer)
    assert ("fused_qkv_a" in layer1) == (name != "tiny-deepseek-v2-lite") and "q_a" not in layer1
    assert ("kv_a" in layer1) == (name == "tiny-deepseek-v2-lite")


def test_deepseek_yarn_scales_softmax_and_rotary():
    """V2-Lite's YaRN: the softmax scale times mscale(4, 0.707)^2 and the rotary's attention factor
    mscale(4, 1) / mscale(4, 0.707), as transformers computes them."""
    import math
    model = load_model(os.path.join(FIXTURES, "tiny-deepseek-v2-lite"), dtype="float32")
    spec = model.family.decoder_spec(model.config)
    m = lambda s, k: 0.1 * k * math.log(s) + 1.0  # noqa: E731
    assert spec.sm_scale == pytest.approx(24 ** -0.5 * m(4, 0.707) ** 2)
    assert spec.rotaries[0].attention_factor == pytest.approx(m(4, 1.0) / m(4, 0.707))
    assert spec.rotaries[0].interleaved


def test_deepseek_old_rope_spelling(tmp_path):
    """A config.json in transformers 4's form (``rope_theta`` + ``rope_scaling`` with ``type``) reads as the
    transformers 5 one (``rope_parameters``)."""
    src = os.path.join(FIXTURES, "tiny-deepseek-v2-lite")
    folder = tmp_path / "old"
    shutil.copytree(src, folder)
    with open(folder / "config.json") as f:
        hf = json.load(f)
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
    with open(folder / "config.json", "w") as f:
        json.dump(hf, f)
    from jaxserve.models.configs import model_config_from_folder
    assert model_config_from_folder(str(folder))[0] == model_config_from_folder(src)[0]


def test_deepseek_skips_mtp_layers(caplog):
    """V3's checkpoint carries a multi-token-prediction layer past the last one: not part of the target model
    (the deepseek_mtp draft head reads it), said once."""
    import logging
    with caplog.at_level(logging.INFO, logger="jaxserve.models.deepseek"):
        model = load_model(os.path.join(FIXTURES, "tiny-deepseek-v3"), dtype="float32")
    assert len(model.params["layers"]) == 3
    assert [r.message for r in caplog.records if "multi-token-prediction" in r.message] == [
        "1 multi-token-prediction layer(s) of this checkpoint are not part of the model (the speculative method "
        "deepseek_mtp loads them as its draft head)"]


@pytest.mark.parametrize("name", [DEEPSEEK[0], pytest.param(DEEPSEEK[1], marks=pytest.mark.slow),
                                  pytest.param(DEEPSEEK[2], marks=pytest.mark.slow)])
def test_deepseek_engine_greedy_matches_hf(name):
    """Through the engine: the prompt three times among others, prefix caching, 8-token chunks, and a block
    pool small enough that the scheduler preempts."""
    llm, golden, outs = engine_with_preemption(name)
    assert llm.engine.core.scheduler.get_stats()["num_preemptions"] > 0
    for i in (0, 2, 4):
        assert outs[i].outputs[0].token_ids == golden["greedy_ids"], f"{name}: copy {i} differs from HF"


def _fp8_folder(folder, src: str, quantized, float_modules=()) -> dict:
    """``src``'s checkpoint with the 2-D tensors ``quantized(name)`` picks in e4m3 and a ``weight_scale_inv``
    (one partial 128 x 128 block each at these sizes), the official FP8 layout; returns the dequantized
    float tensors."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    tensors = {k: v.astype(np.float32) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    ref = dict(tensors)
    fp8_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    for name, w in list(tensors.items()):
        if w.ndim == 2 and quantized(name):
            scale = np.float32(np.abs(w).max() / fp8_max)
            tensors[name] = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            tensors[name.replace(".weight", ".weight_scale_inv")] = np.full((1, 1), scale, np.float32)
            ref[name] = tensors[name].astype(np.float32) * scale
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "modules_to_not_convert": ["lm_head", "re:model.layers.0.mlp.*", *float_modules]}
    os.makedirs(folder)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf | {"quantization_config": qc}, f)
    return ref


def test_deepseek_fp8_block_checkpoint(tmp_path):
    """The official FP8 layout (e4m3 ``[out, in]`` tensors with ``weight_scale_inv`` blocks; router, norms,
    embeddings and lm_head in bf16): the routed and shared experts and ``kv_b`` (``uk``/``uv``) are dequantized at
    load, so the logits equal the dequantized float model's; MLA's q/kv_a projections and ``o`` load as fp8 weights."""
    from safetensors.numpy import save_file

    from jaxserve.quantization.weights import Fp8Weight
    from support.tiny_models import PagedRunner

    src = os.path.join(FIXTURES, "tiny-deepseek-v3")
    ref = _fp8_folder(str(tmp_path / "fp8"), src, lambda n: "experts" in n or "kv_b_proj" in n,
                      ["re:.*self_attn.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)"])
    os.makedirs(tmp_path / "float")
    save_file(ref, str(tmp_path / "float" / "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "float")
    fp8 = load_model(str(tmp_path / "fp8"), dtype="float32")
    assert fp8.params["layers"][1]["experts_gate_up"].dtype == np.float32
    prompt = json.load(open(os.path.join(src, "golden.json")))["prompt_ids"]
    got, want = (PagedRunner(m, max_reqs=1, max_len=16).prompt_logits(prompt)
                 for m in (fp8, load_model(str(tmp_path / "float"), dtype="float32")))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    _fp8_folder(str(tmp_path / "all"), src, lambda n: ("self_attn." in n and "layernorm" not in n) or "experts" in n)
    layer1 = load_model(str(tmp_path / "all"), dtype="float32").params["layers"][1]
    assert all(isinstance(layer1[n], Fp8Weight) for n in ("q_a", "q_b", "kv_a", "o"))
    assert not isinstance(layer1["uk"], Fp8Weight) and not isinstance(layer1["uv"], Fp8Weight) and len(prompt) == 10


def test_deepseek_fused_qkv_a_matches_apart(tmp_path, monkeypatch):
    """A q LoRA of whole 128 x 128 blocks (V3's 1536; here tiny-deepseek-v3's widened to 128): ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` load as one weight, in fp8 too (both modules' scales side by side), and the logits
    equal those of the same checkpoint with the two loaded apart, float and fp8 alike. tiny-deepseek-v3's own
    32 (a partial block) keeps them apart in fp8 (``test_deepseek_fp8_block_checkpoint``)."""
    import ml_dtypes  # noqa: F401  (numpy reads the fixture's bfloat16 tensors)
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from jaxserve.models import deepseek
    from jaxserve.quantization.weights import Fp8Weight
    from support.tiny_models import PagedRunner

    src, wide, rank = os.path.join(FIXTURES, "tiny-deepseek-v3"), tmp_path / "float", 128
    rng = np.random.default_rng(0)
    tensors = {k: v.astype(np.float32) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    for name in [k for k in tensors if "q_a_proj" in k or "q_a_layernorm" in k or "q_b_proj" in k]:
        shape = {"q_a_proj": (rank, 64), "q_a_layernorm": (rank,), "q_b_proj": (4 * 24, rank)}[name.split(".")[-2]]
        tensors[name] = (1.0 if "layernorm" in name else 0.0) + rng.normal(0, 0.1, shape).astype(np.float32)
    shutil.copytree(src, wide)
    save_file(tensors, str(wide / "model.safetensors"))
    with open(wide / "config.json") as f:
        hf = json.load(f)
    with open(wide / "config.json", "w") as f:
        json.dump(hf | {"q_lora_rank": rank}, f)
    _fp8_folder(str(tmp_path / "fp8"), str(wide), lambda n: ("self_attn." in n and "layernorm" not in n)
                or "experts" in n)
    prompt = json.load(open(os.path.join(src, "golden.json")))["prompt_ids"]
    models = {d: load_model(str(tmp_path / d), dtype="float32") for d in ("float", "fp8")}
    monkeypatch.setattr(deepseek, "fuses_qkv_a", lambda hf, q_lora_rank: False)
    for d, fused in models.items():
        apart = load_model(str(tmp_path / d), dtype="float32")
        assert "fused_qkv_a" in fused.params["layers"][1] and "q_a" in apart.params["layers"][1]
        got, want = (PagedRunner(m, max_reqs=1, max_len=16).prompt_logits(prompt) for m in (fused, apart))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=d)
    weight = models["fp8"].params["layers"][1]["fused_qkv_a"]
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "np") as f:
        per_module = [np.full(n, f.get_tensor(f"model.layers.1.self_attn.{m}.weight_scale_inv").item(), np.float32)
                      for m, n in (("q_a_proj", rank), ("kv_a_proj_with_mqa", 40))]
    assert isinstance(weight, Fp8Weight) and weight.shape == (64, rank + 40)
    np.testing.assert_array_equal(np.asarray(weight.scale), np.concatenate(per_module))


def test_fp8_block_scales_join_on_the_outputs():
    """The fused ``cat_t`` build of 128 x 128 block-quantized modules: the weights and their scale blocks side by
    side on the outputs, the product as the dequantized modules'; a module before the last whose outputs end
    inside a block is refused (its blocks and the next module's would share a scale)."""
    import jax.numpy as jnp
    import ml_dtypes

    from jaxserve.errors import ModelLoadError
    from jaxserve.quantization import loading
    from jaxserve.quantization.config import resolve_quantization
    from jaxserve.quantization.weights import matmul

    q = resolve_quantization("auto", {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                              "weight_block_size": [128, 128]}})
    rng = np.random.default_rng(0)

    def source(outs: tuple[int, ...], k: int = 256):
        tensors = {}
        for i, n in enumerate(outs):
            tensors[f"m{i}.weight"] = rng.normal(0, 100, (n, k)).astype(ml_dtypes.float8_e4m3fn)
            tensors[f"m{i}.weight_scale_inv"] = rng.uniform(0.5, 2, (-(-n // 128), k // 128)).astype(np.float32)
        get = tensors.__getitem__
        return get, tensors.__contains__, [f"m{i}.weight" for i in range(len(outs))]

    get, has, names = source((256, 72))
    w = loading.load_linear(q, ("layers", 0, "fused_qkv_a"), names, "cat_t", (256, 328), None, get, has)
    assert w.block and w.scale.shape == (2, 3)
    float_w = np.concatenate(loading.dequantize_fp8_tensors(names, [get(n) for n in names], get, has), axis=0)
    x = rng.normal(0, 1, (3, 256)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), w)), x @ float_w.T, rtol=1e-5, atol=1e-3)
    get, has, names = source((200, 72))
    with pytest.raises(ModelLoadError, match="not a multiple of the 128x128 blocks"):
        loading.load_linear(q, ("layers", 0, "fused_qkv_a"), names, "cat_t", (256, 272), None, get, has)


def test_deepseek_fuses_qkv_a_when_exact():
    """q_a and kv_a fuse with a q LoRA, from float checkpoints and fp8 ones whose q LoRA fills whole scale blocks."""
    from jaxserve.models.deepseek import fuses_qkv_a

    fp8, awq = {"quant_method": "fp8", "weight_block_size": [128, 128]}, {"quant_method": "awq"}
    assert fuses_qkv_a({}, 1536) and fuses_qkv_a({"quantization_config": fp8}, 1536)
    assert not fuses_qkv_a({}, None) and not fuses_qkv_a({"quantization_config": fp8}, 32)
    assert not fuses_qkv_a({"quantization_config": awq}, 1536)


@pytest.mark.parametrize("name,architecture,billions,latent", [
    ("deepseek-v2-lite", "DeepseekV2ForCausalLM", 15.71, 576), ("deepseek-v3-6l", "DeepseekV3ForCausalLM", 38.13, 576)])
def test_deepseek_dummy_configs(name, architecture, billions, latent):
    """The public shapes: parameter counts, the 576-value latent row (a block of 16 tokens over all layers is
    ``16 * 576 * layers`` values), expert parallelism over 8 devices."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import registry
    from jaxserve.models.configs import model_config_from_hf, read_json
    from jaxserve.models.layers.moe import with_expert_parallel
    from jaxserve.models.packaged import DUMMY_CONFIG_DIR
    from jaxserve.parallel import check_tp_compatible
    from jaxserve.runner import kv_cache

    cfg = model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / f"{name}.json")))
    arch, family = registry.resolve_architecture(cfg.architecture)
    family.check_config(cfg)
    shapes = jax.tree.leaves(family.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert arch == architecture
    assert sum(int(np.prod(s)) for s in shapes) / 1e9 == pytest.approx(billions, abs=0.01)
    assert family.kv_cache_shapes(cfg, 2, 16, jnp.bfloat16) == ((2, 16, latent),)
    assert kv_cache.bytes_per_block(cfg, 16, jnp.bfloat16) == cfg.num_layers * 16 * latent * 2
    check_tp_compatible(with_expert_parallel(cfg, True), 8)


def test_deepseek_bench_configs():
    """The H200 DeepSeek configs validate and name DeepSeek models; the suite lists them."""
    from jaxserve.benchmarks.config import load_config
    from jaxserve.benchmarks.models import resolve_model
    from jaxserve.benchmarks.suites import load_suite

    suite = load_suite("h200-deepseek")
    names = [c for run in suite["runs"] for c in run["configs"]]
    for name in names:
        config = load_config(name)
        if config["mode"] != "kernels":
            assert resolve_model(config)[0].architecture.startswith("Deepseek")
    assert len(names) == 8


def test_deepseek_orbax_round_trip(tmp_path):
    """``convert`` keeps the MLA and routing config (q LoRA, groups, router bias) and the stacked experts."""
    check_orbax_round_trip("tiny-deepseek-v3", str(tmp_path / "ckpt"))


def test_deepseek_v3_router_bias_stays_float32(tmp_path):
    """V3's ``e_score_correction_bias`` stays float32 in a bf16 model, as transformers keeps it
    (``_keep_in_fp32_modules_strict``; the official checkpoints store it in F32): rounded to bf16 it would move the
    experts whose biased scores differ by less than its rounding. From safetensors, from an orbax round trip and
    in dummy weights alike; every other weight is bf16."""
    import jax.numpy as jnp
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from jaxserve.models import orbax_io

    src, folder = os.path.join(FIXTURES, "tiny-deepseek-v3"), tmp_path / "f32-bias"
    tensors = {k: v.astype(np.float32) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = tensors[name] + np.float32(1e-4) * np.arange(1, tensors[name].size + 1, dtype=np.float32)
    assert not np.array_equal(bias.astype(ml_dtypes.bfloat16).astype(np.float32), bias)    # bf16 would round it
    tensors[name] = bias
    shutil.copytree(src, folder)
    save_file(tensors, str(folder / "model.safetensors"))

    def check(params):
        leaves = {jnp.dtype(x.dtype) for layer in params["layers"] for n, x in layer.items()
                  if n != "router_bias"}
        assert leaves == {jnp.dtype(jnp.bfloat16)} and params["layers"][1]["router_bias"].dtype == jnp.float32

    model = load_model(str(folder), dtype="bfloat16")
    check(model.params)
    np.testing.assert_array_equal(np.asarray(model.params["layers"][1]["router_bias"]), bias)
    orbax_io.convert(str(folder), str(tmp_path / "ckpt"), dtype="bfloat16")
    restored = load_model(str(tmp_path / "ckpt"))
    check(restored.params)
    np.testing.assert_array_equal(np.asarray(restored.params["layers"][1]["router_bias"]), bias)
    check(model.family.init_dummy_params(model.config, jnp.bfloat16))


def test_deepseek_cut_to_its_dense_layers_serves():
    """A DeepSeek config cut (``hf_overrides``) to its leading dense layers has no MoE layer: the engine has no
    expert load to count and still decodes (it failed adding the load of no layer)."""
    from jaxserve import LLM, SamplingParams
    llm = LLM(os.path.join(FIXTURES, DEEPSEEK[0]), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, token_buckets=[4, 32], hf_overrides={"num_hidden_layers": 1},
              use_tqdm_on_load=False)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert "moe_layers" not in llm.engine.core.stats()
    llm.shutdown()
