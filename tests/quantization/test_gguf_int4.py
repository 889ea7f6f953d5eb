"""GGUF projections kept quantized in the int4 layout (``quantization.gguf_formats``): random blocks of every kept
type (Q4_0, Q4_1, Q4_K; Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 as two int4 planes) and odd shapes dequantize to exactly
the gguf package's values, in numpy and in the jnp reference; the kernels on each plane plus the per-group mins'
correction (the GPU path, interpret mode) equal the reference; the embedded SmolLM2 (Q4_1) and Gemma 3 270M
Q4_K_M give the dequantized path's greedy tokens and report their device bytes."""
from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from jaxserve.errors import ModelLoadError
from jaxserve.kernels import int4_matmul_pallas as k4
from jaxserve.quantization import gguf_formats, int4_formats, weights
from jaxserve.quantization.config import gguf_quantization
from jaxserve.quantization.weights import Int4Weight, bytes_by_storage, describe_bytes
from support.llms import packaged_model_or_skip


def random_rows(rng, qtype, n: int, k: int) -> np.ndarray:
    """``n`` rows of ``k`` values of ``qtype``: random bytes, each block's float16 fields finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    # the float16 fields: d (and m or dmin) first; Q2_K's, Q3_K's and Q6_K's last
    f16 = 1 if qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K) else 2
    start = size - 2 * f16 if qtype in (T.Q2_K, T.Q3_K, T.Q6_K) else 0
    fields = rng.normal(0, 0.05, (n, k // block, f16)).astype(np.float16)
    blocks[..., start:start + 2 * f16] = fields.view(np.uint8).reshape(n, k // block, 2 * f16)
    return blocks.reshape(n, -1)


def int4_weight(parts: int4_formats.Int4Parts) -> Int4Weight:
    return jax.tree.map(jnp.asarray, Int4Weight(
        packed=int4_formats.pack(parts.q & 15), scales=parts.scales, zeros=parts.zeros, perm=None,
        group_size=parts.group_size, mins=parts.mins, super_scales=parts.super_scales, super_mins=parts.super_mins,
        high=int4_formats.pack(parts.q >> 4, parts.high_bits) if parts.high_bits else None, offset=parts.offset,
        high_bits=parts.high_bits or 4))


def dequantized(w: Int4Weight) -> np.ndarray:
    return np.asarray(k4.dequantize_int4(w.packed, w.group_scales(), w.zeros, w.group_size, mins=w.group_mins(),
                                         high=w.high, offset=w.offset, high_bits=w.high_bits))


SHAPES = [(T.Q4_0, 37, 96), (T.Q4_0, 5, 32), (T.Q4_1, 37, 160), (T.Q4_1, 1, 64), (T.Q4_K, 37, 768),
          (T.Q4_K, 3, 256), (T.Q5_0, 37, 96), (T.Q5_1, 7, 64), (T.Q8_0, 37, 160), (T.Q8_0, 1, 32), (T.Q5_K, 37, 512),
          (T.Q6_K, 37, 512), (T.Q6_K, 2, 256), (T.Q2_K, 37, 512), (T.Q3_K, 37, 512), (T.Q3_K, 1, 256)]


@pytest.mark.parametrize("qtype,n,k", SHAPES)
def test_repacked_blocks_are_the_gguf_values_exactly(qtype, n, k):
    rows = random_rows(np.random.default_rng(n * k), qtype, n, k)
    want = gguf_dequantize(rows, qtype)                                  # [N, K], HF layout
    parts = gguf_formats.read_gguf(rows, qtype, (n, k), "w")
    np.testing.assert_array_equal(int4_formats.dequantize(parts).T, want)
    np.testing.assert_array_equal(dequantized(int4_weight(parts)).T, want)


def test_the_kept_types():
    assert {T(t).name for t in gguf_formats.KEPT_TYPES} == {"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1",
                                                            "Q5_K", "Q6_K", "Q8_0"}
    assert not any(gguf_formats.kept(t) for t in (T.F16, T.F32, T.BF16, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.TQ1_0))
    with pytest.raises(ModelLoadError, match="IQ4_NL has no int4 form"):
        gguf_formats.read_gguf(np.zeros((1, 18), np.uint8), T.IQ4_NL, (1, 32), "w")


def test_gate_and_up_stack_with_their_mins_and_super_scales():
    rng = np.random.default_rng(1)
    gate, up = (gguf_formats.read_gguf(random_rows(rng, T.Q4_K, 24, 512), T.Q4_K, (24, 512), p) for p in "gu")
    both = int4_formats.combine([gate, up], "stack_t", "gate_up")
    assert both.q.shape == (512, 2, 24) and both.super_mins.shape == (2, 2, 24) and both.zeros is None
    np.testing.assert_array_equal(int4_formats.dequantize(both),
                                  np.stack([int4_formats.dequantize(gate), int4_formats.dequantize(up)], 1))
    for other in (T.Q4_0, T.Q5_K):
        up = gguf_formats.read_gguf(random_rows(rng, other, 24, 512), other, (24, 512), "u")
        with pytest.raises(ModelLoadError, match="different int4 forms"):
            int4_formats.combine([gate, up], "stack_t", "gate_up")


@pytest.mark.parametrize("qtype,method,m", [(T.Q4_K, "fma", 1), (T.Q4_K, "gemv", 3), (T.Q4_1, "dot", 5),
                                            (T.Q4_0, "fma", 2), (T.Q8_0, "gemv", 2), (T.Q5_K, "dot", 3),
                                            (T.Q6_K, "fma", 1), (T.Q5_0, "fma", 1), (T.Q3_K, "gemv", 2),
                                            (T.Q2_K, "fma", 1)])
def test_gpu_path_kernels_and_the_mins_correction_equal_the_reference(monkeypatch, qtype, method, m):
    """``weights.matmul`` as a GPU runs it (the Pallas kernel, here in interpret mode, on each int4 plane, then
    ``x``'s group sums times the mins subtracted) against ``x`` times the dequantized weight."""
    rng = np.random.default_rng(m)
    n, k = 48, 512
    w = int4_weight(gguf_formats.read_gguf(random_rows(rng, qtype, n, k), qtype, (n, k), "w"))
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    want = np.asarray(x) @ dequantized(w)
    monkeypatch.setattr(weights.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(weights, "int4_step_kernel", lambda *a: "pallas")
    monkeypatch.setattr(weights.int4_kernel, "default_config", lambda *a, **kw: k4.Config(method, block_n=16))
    monkeypatch.setattr(weights.int4_kernel, "int4_matmul", functools.partial(k4.int4_matmul, interpret=True))
    got = np.asarray(weights.matmul(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_flag_picks_the_path():
    assert gguf_quantization("none", "m.gguf", ()) is None
    for flag in ("auto", "gguf", None):
        q = gguf_quantization(flag, "m.gguf", ("model.layers.0.mlp.down_proj",))
        assert (q.method, q.weights) == ("gguf", "int4")
        assert not q.quantizes("model.layers.0.mlp.down_proj") and q.quantizes("model.layers.0.mlp.up_proj")
    with pytest.raises(ModelLoadError, match="is a GGUF file; pass auto or gguf"):
        gguf_quantization("awq", "m.gguf", ())
    from jaxserve.models import load_model
    with pytest.raises(ModelLoadError, match="--quantization fp8: SmolLM2-135M-Instruct.Q4_1.gguf is a GGUF file"):
        load_model(None, quantization="fp8")


def test_bytes_by_storage_count_every_array_of_a_quantized_weight():
    rows = random_rows(np.random.default_rng(2), T.Q4_K, 64, 512)
    tree = {"w": int4_weight(gguf_formats.read_gguf(rows, T.Q4_K, (64, 512), "w")), "norm": jnp.ones(64)}
    # 4-bit values, 6-bit scales and mins as bytes per 32, two float16 factors per 256
    assert bytes_by_storage(tree) == {"int4": (512 * 64 * 4.625 / 8, 512 * 64), "float32": (256, 64)}
    assert describe_bytes(tree) == "int4 0.000 GB (4.62 bits/weight), float32 0.000 GB"
    # a high plane of 4, 1 or 2 bits and a float16 scale per 32 (Q6_K: an int8 scale per 16, a float16 per 256)
    for qtype, kind, bits in ((T.Q8_0, "int8", 8.5), (T.Q5_0, "int5", 5.5), (T.Q6_K, "int6", 6.5625)):
        rows = random_rows(np.random.default_rng(3), qtype, 64, 512)
        wide = int4_weight(gguf_formats.read_gguf(rows, qtype, (64, 512), "w"))
        assert bytes_by_storage({"w": wide}) == {kind: (512 * 64 * bits / 8, 512 * 64)}


# ------------------------------------------------------------------------------------------- models
PROMPTS = [[1, 504, 3575, 282, 4649, 314], [2, 818, 5279, 529, 6056, 563]]
TOKENS = 6


def _greedy_and_bytes(model, quantization: str) -> tuple[list, dict, object]:
    from jaxserve import LLM, SamplingParams
    llm = LLM(model, quantization=quantization, dtype="float32", max_model_len=64, max_num_batched_tokens=32,
              max_num_seqs=2, kv_cache_memory_bytes=1 << 22, skip_warmup=True, use_tqdm_on_load=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    model = llm.engine.core.model
    return [list(o.outputs[0].token_ids) for o in outs], bytes_by_storage(model.params), model


@pytest.mark.parametrize("name,kept,bits", [
    (None, "Q4_1 210", 5.0),                                        # the embedded SmolLM2: every projection Q4_1
    # Gemma 3 270M Q4_K_M: llama.cpp falls back to Q5_0 where a row of 640 cannot hold 256-value super-blocks
    pytest.param("gemma3-270m", "Q4_K 27, Q5_0 81, Q6_K 9, Q8_0 9", 5.46, marks=pytest.mark.slow),   # ~30 s
])
def test_gguf_model_keeps_its_projections_quantized_with_the_same_greedy_tokens(caplog, name, kept, bits):
    model = packaged_model_or_skip(name) if name else None
    with caplog.at_level(logging.INFO):
        tokens, storage, loaded = _greedy_and_bytes(model, "auto")
    lines = [r.getMessage() for r in caplog.records if "projections kept quantized" in r.getMessage()]
    assert len(lines) == 1 and f"projections kept quantized: {kept}; dequantized: none;" in lines[0], lines
    (weights_line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up weights")]
    assert re.search(r"GB/s\), by storage: float32 [0-9.]+ GB, .*int4 [0-9.]+ GB \((4\.62|5\.00) bits/weight\)",
                     weights_line), weights_line
    assert loaded.quantization == "gguf"
    quantized = [v for kind, v in storage.items() if kind.startswith("int")]
    nbytes, count = map(sum, zip(*quantized))
    assert 8 * nbytes / count == pytest.approx(bits, abs=0.05)
    float_tokens, float_storage, _ = _greedy_and_bytes(model, "none")
    assert set(float_storage) == {"float32"}
    # the reference dequantizes to the float path's weights exactly (float32 on CPU): the same tokens
    assert tokens == float_tokens
    assert float_storage["float32"][0] - storage["float32"][0] == 4 * count       # the projections' float32 bytes


def test_a_gguf_weight_serializes_in_a_stored_program():
    """A stored step program takes the weights as inputs: the new arrays (None or not) and static fields
    (offset, high_bits) come back the same."""
    from jaxserve.runner import program_cache
    program_cache._register_step_types()
    rows = random_rows(np.random.default_rng(4), T.Q6_K, 16, 256)
    w = int4_weight(gguf_formats.read_gguf(rows, T.Q6_K, (16, 256), "w"))
    exported = jax.export.export(jax.jit(lambda a: (a.group_scales().sum(), a)))(w)
    total, back = jax.export.deserialize(exported.serialize()).call(w)
    assert float(total) == pytest.approx(float(w.group_scales().sum()), rel=1e-5)
    assert (back.offset, back.high_bits, back.group_size, back.zeros, back.mins) == (32, 2, 16, None, None)
    np.testing.assert_array_equal(np.asarray(back.high), np.asarray(w.high))


def test_a_warm_start_maps_the_repacked_weights(tmp_path, monkeypatch):
    """The weight cache keeps the quantized tree too (its key has the int4 fields): a second load of the
    embedded SmolLM2 repacks nothing and gives the same weights; ``none`` is another entry."""
    from jaxserve.models import gguf_loader, packaged, weight_cache
    from support.tiny_models import params_equal

    folder = tmp_path / "weights"
    monkeypatch.setattr(weight_cache, "directory_for", lambda compile_cache_dir: str(folder))
    calls, real = [], gguf_loader.load_weights
    monkeypatch.setattr(gguf_loader, "load_weights", lambda *a, **kw: calls.append(kw.get("quant")) or real(*a, **kw))
    path = packaged.embedded_model_path()
    first = gguf_loader.load_gguf(path, dtype="float32")
    again = gguf_loader.load_gguf(path, dtype="float32")
    assert len(calls) == 1 and calls[0].method == "gguf"
    assert isinstance(again.params["layers"][0]["q"], Int4Weight) and params_equal(first.params, again.params)
    gguf_loader.load_gguf(path, dtype="float32", quantization="none")
    assert len(calls) == 2 and calls[1] is None


_TP_CHECK = """
import json
from jaxserve import LLM, SamplingParams
out = {}
for tp in (1, 2):
    llm = LLM("gemma3-270m", tensor_parallel_size=tp, dtype="float32", max_model_len=64, max_num_batched_tokens=32,
              max_num_seqs=2, kv_cache_memory_bytes=1 << 22, skip_warmup=True, use_tqdm_on_load=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in %r],
                        SamplingParams(max_tokens=%d, temperature=0.0, ignore_eos=True), use_tqdm=False)
    out[tp] = [list(o.outputs[0].token_ids) for o in outs]
    o = llm.engine.core.model.params["layers"][0]["o"]
    out["o_spec"] = str(o.super_scales.sharding.spec) if tp == 2 else None
    llm.shutdown()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_gemma3_q4_k_m_at_tp2_gives_tp1s_greedy_tokens():
    """Row-parallel Q4_K projections split their packed rows, scales, mins and super-blocks alike (fake devices)."""
    from support.fake_devices import fake_device_report
    packaged_model_or_skip("gemma3-270m")
    report = fake_device_report(["-c", _TP_CHECK % (PROMPTS, TOKENS)], 2)
    assert report["1"] == report["2"] and report["o_spec"] == "P('tp', None)"
