"""Quantized checkpoints: tiny Llama checkpoints written here in AWQ, GPTQ (sym / asym / act-order),
compressed-tensors (int4 pack-quantized, fp8) and FP8 (per-tensor, 128x128 blocks) layouts by the formats'
packing rules, from one float model quantized by the small numpy routines below. The loader must reproduce
the numpy reference weights exactly and the model's logits must match the dequantized float model's; the
flag/checkpoint mismatches are clear errors; online fp8 and dummy quantized weights run. Tensor parallelism
on fake CPU devices: ``test_quant_tensor_parallel.py``."""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.kernels import int4_matmul_pallas as int4_kernel
from jaxserve.models.loader import load_model
from jaxserve.quantization import Fp8Weight, Int4Weight
from support.safetensors_files import write_folder
from support.tp_greedy import GreedyDecoder

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 256,
      "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
      "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ------------------------------------------------------------------------------ writing checkpoints
def float_model(hf: dict = HF, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights, std 1/sqrt(fan_in) so every layer matters to the logits."""
    rng = np.random.default_rng(seed)
    h, i, d = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q_out, kv_out = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (q_out, h), "self_attn.k_proj": (kv_out, h), "self_attn.v_proj": (kv_out, h),
              "self_attn.o_proj": (h, q_out), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
              "mlp.down_proj": (h, i)}
    out = {"model.embed_tokens.weight": rng.standard_normal((hf["vocab_size"], h)).astype(np.float32),
           "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
           "lm_head.weight": (rng.standard_normal((hf["vocab_size"], h)) / np.sqrt(h)).astype(np.float32)}
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        out[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        for name, (n, k) in shapes.items():
            out[f"{p}{name}.weight"] = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return out


def quantize_int4(w_kn: np.ndarray, g_idx: np.ndarray, symmetric: bool, scale_dtype=np.float16):
    """Round-to-nearest int4 of ``w [K, N]`` by the groups ``g_idx [K]``: (q [K, N], scales [G, N], zeros [G, N],
    the float32 weight they stand for)."""
    groups = int(g_idx.max()) + 1
    q = np.zeros(w_kn.shape, np.uint8)
    scales = np.zeros((groups, w_kn.shape[1]), scale_dtype)
    zeros = np.zeros((groups, w_kn.shape[1]), np.int64)
    for g in range(groups):
        rows = w_kn[g_idx == g]
        if symmetric:
            s = (np.abs(rows).max(0) / 7).astype(scale_dtype).astype(np.float32)
            z = np.full(s.shape, 8)
        else:
            lo, hi = rows.min(0), rows.max(0)
            s = ((hi - lo) / 15).astype(scale_dtype).astype(np.float32)
            z = np.clip(np.round(-lo / s), 0, 15).astype(np.int64)
        q[g_idx == g] = np.clip(np.round(rows / s) + z, 0, 15)
        scales[g], zeros[g] = s, z
    ref = ((q.astype(np.float32) - zeros[g_idx]) * scales.astype(np.float32)[g_idx]).astype(np.float32)
    return q, scales, zeros, ref


def pack_cols(v: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """uint ``[R, 8C]`` → int32 ``[R, C]``: nibble ``i`` of word ``c`` holds column ``8c + order[i]``."""
    v = v.astype(np.uint32).reshape(v.shape[0], -1, 8)
    out = np.zeros(v.shape[:2], np.uint32)
    for i, col in enumerate(order):
        out |= v[:, :, col] << np.uint32(4 * i)
    return out.view(np.int32)


def pack_rows(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pack_cols(np.ascontiguousarray(v.T)).T)


def quantized_checkpoint(fmt: str, group: int = 128, symmetric: bool = False, desc_act: bool = False,
                         hf: dict = HF, seed: int = 0):
    """(tensors, quantization_config, reference float tensors, reference weights in the loaded row order)."""
    rng = np.random.default_rng(seed + 1)
    tensors = float_model(hf, seed)
    ref = dict(tensors)
    loaded_order = {}
    orders: dict = {}     # act-order comes from the layer input's statistics: q/k/v share one, gate/up one
    for name in list(tensors):
        module = name[:-len(".weight")]
        if not module.endswith(LINEARS):
            continue
        w_kn = tensors.pop(name).T
        k = w_kn.shape[0]
        g_idx = np.arange(k) // group
        if desc_act:      # act-order: the groups take the rows in a random order, the weight keeps its own
            shared_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj",
                                                                                                   "gate_proj")
            order = orders.setdefault(shared_input, rng.permutation(k))
            g_idx = np.empty(k, np.int64)
            g_idx[order] = np.arange(k) // group
        q, scales, zeros, w_ref = quantize_int4(w_kn, g_idx, symmetric,
                                                ml_dtypes.bfloat16 if fmt == "compressed-tensors" else np.float16)
        ref[name] = np.ascontiguousarray(w_ref.T)
        loaded_order[module] = w_ref[np.argsort(g_idx, kind="stable")]
        if fmt == "awq":
            tensors |= {f"{module}.qweight": pack_cols(q, AWQ_ORDER), f"{module}.qzeros": pack_cols(zeros, AWQ_ORDER),
                        f"{module}.scales": scales}
        elif fmt == "gptq":
            tensors |= {f"{module}.qweight": pack_rows(q), f"{module}.qzeros": pack_cols((zeros - 1) & 15),
                        f"{module}.scales": scales, f"{module}.g_idx": g_idx.astype(np.int32)}
        else:
            n = w_kn.shape[1]
            tensors |= {f"{module}.weight_packed": pack_cols(np.ascontiguousarray(q.T)),
                        f"{module}.weight_scale": np.ascontiguousarray(scales.T),
                        f"{module}.weight_shape": np.array([n, k], np.int64)}
            if not symmetric:
                tensors[f"{module}.weight_zero_point"] = pack_rows(np.ascontiguousarray(zeros.T))
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    elif fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": symmetric, "desc_act": desc_act}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                  "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                  "group_size": group}}}}
    return tensors, qc, ref, loaded_order


def fp8_checkpoint(scales: str, activation: str = "dynamic", hf: dict = HF, seed: int = 0):
    """FP8 tensors (``scales``: tensor | channel | block) and their reference float tensors."""
    tensors, ref = float_model(hf, seed), {}
    fp8_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    for name in list(tensors):
        module = name[:-len(".weight")]
        if not module.endswith(LINEARS):
            continue
        w = tensors[name]
        n, k = w.shape
        if scales == "block":
            blocks = np.abs(w).reshape(n // 128, 128, k // 128, 128).max(axis=(1, 3)) / fp8_max
            s_full = np.repeat(np.repeat(blocks, 128, 0), 128, 1)
            tensors[f"{module}.weight_scale_inv"] = blocks.astype(np.float32)
        elif scales == "channel":
            s_col = np.abs(w).max(1, keepdims=True) / fp8_max
            s_full = np.broadcast_to(s_col, w.shape)
            tensors[f"{module}.weight_scale"] = s_col.astype(np.float32)
        else:
            s = np.float32(np.abs(w).max() / fp8_max)
            s_full = np.full(w.shape, s, np.float32)
            tensors[f"{module}.weight_scale"] = np.array(s, np.float32)
        wq = (w / s_full).astype(ml_dtypes.float8_e4m3fn)
        tensors[name] = wq
        ref[name] = wq.astype(np.float32) * s_full.astype(np.float32)
        if activation == "static":
            tensors[f"{module}.input_scale"] = np.array(4.0 / fp8_max, np.float32)
    if scales == "channel":
        act = {"dynamic": True, "strategy": "token", "type": "float", "num_bits": 8} if activation == "dynamic" \
            else {"dynamic": False, "strategy": "tensor", "type": "float", "num_bits": 8}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": act, "weights": {
                  "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}}
    else:
        qc = {"quant_method": "fp8", "activation_scheme": activation}
        if scales == "block":
            qc["weight_block_size"] = [128, 128]
    full_ref = float_model(hf, seed) | ref
    return tensors, qc, full_ref


def logits_of(model) -> np.ndarray:
    return GreedyDecoder(model.config, model.params, max_new_tokens=2).generate()[1]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("quant")


# ------------------------------------------------------------------------------------------- int4
INT4_CASES = {"awq": dict(fmt="awq"), "gptq-sym": dict(fmt="gptq", symmetric=True),
              "gptq-asym-g64": dict(fmt="gptq", group=64),
              "gptq-desc-act": dict(fmt="gptq", symmetric=True, desc_act=True),
              "ct-sym": dict(fmt="compressed-tensors", symmetric=True),
              "ct-asym-g32": dict(fmt="compressed-tensors", group=32)}


@pytest.mark.parametrize("case", list(INT4_CASES))
def test_int4_checkpoint_loads_the_reference_weights_and_logits(case, tmp):
    tensors, qc, ref, loaded_order = quantized_checkpoint(**INT4_CASES[case])
    folder = write_folder(tmp / case, tensors, HF | {"quantization_config": qc})
    ref_folder = write_folder(tmp / f"{case}-float", ref, HF | {"torch_dtype": "float32"})
    model = load_model(folder, dtype="float32")
    assert model.quantization == qc["quant_method"]
    layer = model.params["layers"][1]
    # q, k and v load as one qkv weight for AWQ and GPTQ without act-order (``with_fused_qkv``), q's columns first
    fused = INT4_CASES[case]["fmt"] in ("awq", "gptq") and not INT4_CASES[case].get("desc_act")
    assert ("qkv" in layer) == fused and ("q" in layer) != fused
    for weight, module in (("qkv" if fused else "q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
        w = layer[weight]
        assert isinstance(w, Int4Weight) and w.group_size == INT4_CASES[case].get("group", 128)
        got = np.asarray(int4_kernel.dequantize_int4(w.packed, w.scales, w.zeros, w.group_size))
        want = loaded_order[f"model.layers.1.{module}"]
        np.testing.assert_array_equal(got[:, :want.shape[1]], want)
        assert (w.perm is not None) == INT4_CASES[case].get("desc_act", False)
    gate_up = layer["gate_up"]
    assert gate_up.shape == (256, 2, 512)
    np.testing.assert_array_equal(
        np.asarray(int4_kernel.dequantize_int4(gate_up.packed, gate_up.scales, gate_up.zeros, gate_up.group_size))[:, 1],
        loaded_order["model.layers.1.mlp.up_proj"])
    assert not isinstance(model.params["lm_head"], Int4Weight)
    np.testing.assert_allclose(logits_of(model), logits_of(load_model(ref_folder, dtype="float32")),
                               rtol=2e-4, atol=2e-4)


def test_int4_bfloat16_matches_the_float_model_within_bf16(tmp):
    tensors, qc, ref, _ = quantized_checkpoint("awq")
    folder = write_folder(tmp / "awq-bf16", tensors, HF | {"quantization_config": qc})
    ref_folder = write_folder(tmp / "awq-bf16-float", ref, HF | {"torch_dtype": "float32"})
    got = logits_of(load_model(folder, dtype="bfloat16"))
    want = logits_of(load_model(ref_folder, dtype="float32"))
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


# -------------------------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("scales,activation", [("tensor", "dynamic"), ("channel", "dynamic"),
                                               ("channel", "static"), ("block", "dynamic")])
def test_fp8_checkpoint_matches_the_dequantized_model(scales, activation, tmp):
    tensors, qc, ref = fp8_checkpoint(scales, activation)
    name = f"fp8-{scales}-{activation}"
    model = load_model(write_folder(tmp / name, tensors, HF | {"quantization_config": qc}), dtype="float32")
    w = model.params["layers"][0]["gate_up"]
    assert isinstance(w, Fp8Weight) and w.weight.dtype == jnp.float8_e4m3fn and w.block == (scales == "block")
    assert (w.input_scale is not None) == (activation == "static")
    want = logits_of(load_model(write_folder(tmp / f"{name}-float", ref, HF | {"torch_dtype": "float32"}),
                                dtype="float32"))
    got = logits_of(model)
    if scales == "block":        # W8A16: the weights are exact, the activations stay float
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    else:                        # W8A8: e4m3 activations (3 mantissa bits)
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max(), np.abs(got - want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.5


def test_online_fp8_quantizes_a_float_checkpoint(tmp):
    folder = write_folder(tmp / "float", float_model(), HF | {"torch_dtype": "float32"})
    model = load_model(folder, dtype="float32", quantization="fp8")
    assert model.quantization == "fp8"
    w = model.params["layers"][0]["qkv"]           # q, k and v as one weight: 256 + 2 x 128 outputs
    assert isinstance(w, Fp8Weight) and w.scale.shape == (512,) and not w.block
    assert model.params["embed"].dtype == jnp.float32
    got, want = logits_of(model), logits_of(load_model(folder, dtype="float32"))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_dummy_weights_take_the_quantized_storage(tmp):
    folder = write_folder(tmp / "float-dummy", float_model(), HF | {"torch_dtype": "float32"})
    for method, cls in (("awq", Int4Weight), ("gptq", Int4Weight), ("fp8", Fp8Weight)):
        model = load_model(folder, dtype="bfloat16", load_format="dummy", quantization=method)
        assert model.quantization == method
        assert all(isinstance(model.params["layers"][0][n], cls) for n in ("qkv", "o", "gate_up", "down"))
        assert np.isfinite(logits_of(model)).all()


@pytest.mark.parametrize("case", ["awq", "gptq-asym-g64", "fp8-block", "fp8-channel", "online-fp8"])
def test_fused_qkv_gives_the_three_projections_logits(case, tmp, monkeypatch):
    """A quantized model's q, k and v as one ``qkv`` weight (one GEMM a layer) give the logits of the three
    weights they were loaded from (``JAXSERVE_FUSED_QKV=0``). (The engine's greedy run of a fused GPTQ model:
    ``test_engine_greedy_continuations_match_the_dequantized_model``.)"""
    if case.startswith("fp8-"):
        tensors, qc, _ = fp8_checkpoint(case[4:], "dynamic")
        folder = write_folder(tmp / f"fused-{case}", tensors, HF | {"quantization_config": qc})
    elif case == "online-fp8":
        folder = write_folder(tmp / "fused-float", float_model(), HF | {"torch_dtype": "float32"})
    else:
        tensors, qc, _, _ = quantized_checkpoint(**INT4_CASES[case])
        folder = write_folder(tmp / f"fused-{case}", tensors, HF | {"quantization_config": qc})
    quantization = "fp8" if case == "online-fp8" else "auto"
    fused = load_model(folder, dtype="float32", quantization=quantization)
    monkeypatch.setenv("JAXSERVE_FUSED_QKV", "0")
    apart = load_model(folder, dtype="float32", quantization=quantization)
    assert all("qkv" in layer and "q" not in layer for layer in fused.params["layers"])
    assert all("qkv" not in layer and "v" in layer for layer in apart.params["layers"])
    np.testing.assert_allclose(logits_of(fused), logits_of(apart), rtol=1e-5, atol=1e-5)


def test_fused_qkv_stays_off_where_it_does_not_apply(tmp):
    """Three weights where one cannot stand for them: act-order int4, fp8 with static activation scales
    (each module's own), a tensor-parallel mesh, a float model."""
    from jaxserve.models import registry
    from jaxserve.models.configs import model_config_from_hf
    from jaxserve.models.loaded_model import with_fused_qkv
    from jaxserve.quantization.config import QuantConfig

    cfg = model_config_from_hf(HF)
    _, family = registry.resolve_architecture(HF["architectures"])
    awq = QuantConfig(method="awq", weights="int4")
    assert with_fused_qkv(cfg, family, awq, None).extra_dict.get("fused_qkv")
    for quant, mesh in ((QuantConfig(method="gptq", weights="int4", desc_act=True), None),
                        (QuantConfig(method="fp8", weights="fp8", activation_scheme="static"), None),
                        (awq, object()), (None, None)):
        assert with_fused_qkv(cfg, family, quant, mesh) is cfg


# ----------------------------------------------------------------------------------------- errors
def test_flag_and_checkpoint_mismatches_are_clear_errors(tmp):
    tensors, qc, _, _ = quantized_checkpoint("awq")
    folder = write_folder(tmp / "awq-errors", tensors, HF | {"quantization_config": qc})
    with pytest.raises(ModelLoadError, match="--quantization gptq does not match .* quantized with awq"):
        load_model(folder, quantization="gptq")
    with pytest.raises(ModelLoadError, match="quantized with awq .* pass --quantization awq or auto"):
        load_model(folder, quantization="none")
    float_folder = write_folder(tmp / "float-errors", float_model(), HF)
    with pytest.raises(ModelLoadError, match="--quantization awq: .* no quantization_config .* only fp8"):
        load_model(float_folder, quantization="awq")
    with pytest.raises(ModelLoadError, match="quantization 'int3' is not supported"):
        load_model(float_folder, quantization="int3")
    # a checkpoint whose tensors do not match its own quantization_config
    with pytest.raises(ModelLoadError, match="qweight not found"):
        load_model(write_folder(tmp / "gptq-says-awq-has", float_model(),
                                HF | {"quantization_config": qc | {"quant_method": "gptq"}}))
    with pytest.raises(ModelLoadError, match="AWQ version 'gemv' is not supported"):
        load_model(write_folder(tmp / "awq-gemv", tensors, HF | {"quantization_config": qc | {"version": "gemv"}}))
    with pytest.raises(ModelLoadError, match="8-bit gptq weights are not supported"):
        load_model(write_folder(tmp / "gptq-8bit", tensors, HF | {"quantization_config": {
            "quant_method": "gptq", "bits": 8, "group_size": 128}}))


def test_gptq_act_order_gate_and_up_must_share_their_permutation(tmp):
    tensors, qc, _, _ = quantized_checkpoint("gptq", symmetric=True, desc_act=True)
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = np.ascontiguousarray(tensors[name][::-1])
    with pytest.raises(ModelLoadError, match="gate_up: its modules have different act-order permutations"):
        load_model(write_folder(tmp / "gptq-two-orders", tensors, HF | {"quantization_config": qc}))


def test_gguf_and_orbax_take_no_quantization_flag():
    from jaxserve.models.loaded_model import float_only
    with pytest.raises(ModelLoadError, match="GGUF file"):
        float_only("awq", "x.gguf is a GGUF file (its weights are dequantized at load)")
    float_only("auto", "anything")
    float_only("none", "anything")


def test_engine_greedy_continuations_match_the_dequantized_model(tmp):
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    tensors, qc, ref, _ = quantized_checkpoint("gptq", symmetric=False)
    folders = [write_folder(tmp / "engine-gptq", tensors, HF | {"quantization_config": qc}),
               write_folder(tmp / "engine-gptq-float", ref, HF | {"torch_dtype": "float32"})]
    prompts = [[5, 17, 99, 3, 42, 7, 250], [1, 2, 3, 4]]
    outs = []
    for folder in folders:
        llm = LLM(folder, dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2,
                  kv_cache_memory_bytes=1 << 21, skip_warmup=True, compilation_cache_dir="", use_tqdm_on_load=False)
        assert llm.engine.core.model.quantization == (None if folder.endswith("float") else "gptq")
        res = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        outs.append([r.outputs[0].token_ids for r in res])
    assert outs[0] == outs[1]


def test_roofline_counts_the_quantized_bytes():
    from jaxserve.benchmarks import roofline
    from jaxserve.models.configs import model_config_from_hf
    from jaxserve.models.packaged import DUMMY_CONFIG_DIR
    from jaxserve.models.configs import read_json

    cfg = model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / "llama-3.1-8b.json")))
    bf16 = roofline.model_cost(cfg, "bfloat16").weight_bytes
    int4 = roofline.model_cost(cfg, "bfloat16", quantization="awq").weight_bytes
    fp8 = roofline.model_cost(cfg, "bfloat16", quantization="fp8").weight_bytes
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size                 # stays bf16
    projections = (bf16 - lm_head) / 2                             # norms are a rounding error here
    assert abs(int4 - (lm_head + projections * (0.5 + 3 / 128))) < 0.01e9
    assert abs(fp8 - (lm_head + projections)) < 0.01e9


def test_ignored_modules_stay_float(tmp):
    tensors, qc, ref, _ = quantized_checkpoint("compressed-tensors", symmetric=True)
    for name in ("weight_packed", "weight_scale", "weight_shape"):   # layer 1's down_proj left in float
        del tensors[f"model.layers.1.mlp.down_proj.{name}"]
    tensors["model.layers.1.mlp.down_proj.weight"] = ref["model.layers.1.mlp.down_proj.weight"]
    qc["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]
    model = load_model(write_folder(tmp / "ct-ignore", tensors, HF | {"quantization_config": qc}), dtype="float32")
    assert isinstance(model.params["layers"][0]["down"], Int4Weight)
    assert not isinstance(model.params["layers"][1]["down"], Int4Weight)
    want = logits_of(load_model(write_folder(tmp / "ct-ignore-float", ref, HF | {"torch_dtype": "float32"}),
                                dtype="float32"))
    np.testing.assert_allclose(logits_of(model), want, rtol=2e-4, atol=2e-4)
