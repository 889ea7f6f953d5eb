"""kernels/decode_gemv: its reference semantics against the model's own ops, the split heuristic, and the model's
fused decode path driven with the reference standing in for the CUDA kernel (which needs a GPU:
``benchmarks/decode_gemv_probe.py`` checks it there against the same reference)."""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import decode_gemv as dg
from jaxserve.models import llama

sys.path.insert(0, os.path.dirname(__file__))
from tp_greedy import GreedyDecoder, random_params, tiny_config  # noqa: E402

BF = jnp.bfloat16


def _rand(key, shape, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(BF)


def _rope(t, d, start=7):
    cos, sin = llama.rope_cos_sin(jnp.arange(start, start + t), llama.rope_inv_freq(tiny_config(head_dim=d)), BF)
    return cos, sin


def test_reference_matches_the_models_ops():
    t, k, d = 3, 64, 16
    ks = jax.random.split(jax.random.key(0), 8)
    x = _rand(ks[0], (t, k))
    wq, wk, wv = _rand(ks[1], (k, 4 * d), 0.2), _rand(ks[2], (k, 2 * d), 0.2), _rand(ks[3], (k, 2 * d), 0.2)
    cos, sin = _rope(t, d)
    got = dg.reference(x, [wq, wk, wv], rope=(cos, sin), rope_mask=0b011, head_dim=d)
    q = llama.apply_rope((x @ wq).reshape(t, 4, d), cos, sin).reshape(t, -1)
    kk = llama.apply_rope((x @ wk).reshape(t, 2, d), cos, sin).reshape(t, -1)
    want = jnp.concatenate([q, kk, x @ wv], axis=1)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    res = _rand(ks[4], (t, 32))
    wo = _rand(ks[5], (k, 32), 0.2)
    np.testing.assert_array_equal(np.asarray(dg.reference(x, [wo], residual=res), np.float32),
                                  np.asarray(res + x @ wo, np.float32))

    wgu = _rand(ks[6], (k, 2, 48), 0.2)
    gu = jnp.einsum("th,hci->tci", x, wgu)
    want = np.asarray(jax.nn.silu(gu[:, 0]) * gu[:, 1], np.float32)
    got = np.asarray(dg.reference(x, [wgu], silu=True), np.float32)
    assert got.shape == (t, 48)
    # XLA rounds inside its bf16 sigmoid too: within two bf16 steps of the value
    np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=1e-6)


def test_default_splits_fill_one_wave():
    # Llama-3.1-8B at TP=1, 132 SMs, 2 CTAs per SM: 264 CTA slots, never a partial second wave
    assert dg.num_tiles([4096, 1024, 1024], silu=False) == 48          # q, k, v: 128 columns per tile
    assert dg.default_splits(4096, 48, num_sms=132, ctas_per_sm=2) == 5
    assert dg.num_tiles([14336], silu=True) == 224                     # 64 gate + 64 up columns per tile
    assert dg.default_splits(4096, 224, num_sms=132, ctas_per_sm=2) == 1
    assert dg.default_splits(14336, 32, num_sms=132, ctas_per_sm=2) == 8
    for k, tiles in [(14336, 16), (128, 1), (4096, 1000), (576, 5), (2048, 1)]:
        s = dg.default_splits(k, tiles, num_sms=132, ctas_per_sm=2)
        assert 1 <= s <= max(1, k // 128)                              # one 16-row block per warp at least
        assert s == 1 or s * tiles <= 264


def test_applies_only_when_enabled_small_and_bf16(monkeypatch):
    x = jnp.zeros((4, 16), BF)
    assert not dg.applies(4, x)            # not enabled (no GPU here)
    monkeypatch.setattr(dg, "_enabled", True)
    assert dg.applies(4, x) and dg.applies(8, x)
    assert not dg.applies(9, x) and not dg.applies(4, x.astype(jnp.float32))
    assert not dg.applies(4, jnp.zeros((4, 24), BF))                   # K must be a multiple of 16
    assert dg.fits(4096, 14336, 128) and dg.fits(576, 1536, 64) and not dg.fits(4096, 14336, 96)


@pytest.fixture(scope="module")
def decoders():
    """Greedy tokens/logits of a bf16 tiny Llama on steps of 8 token slots, without and with the fused path."""
    cfg = tiny_config(head_dim=16)
    params = random_params(cfg, seed=5, dtype=BF)
    prompts = [[5, 17, 99], [1, 2, 3, 4]]             # 7 tokens: every step is one 8-slot step
    base = GreedyDecoder(cfg, params, None, prompts=prompts, max_new_tokens=5).generate()
    calls = []

    def stand_in(x, weights, **kw):
        calls.append((tuple(x.shape), len(weights), "silu" if kw.get("silu") else
                      "residual" if kw.get("residual") is not None else "rope" if kw.get("rope") else "plain"))
        return dg.reference(x, weights, **kw)

    real = dg.gemv
    dg.gemv, dg._enabled = stand_in, True
    try:
        fused = GreedyDecoder(cfg, params, None, prompts=prompts, max_new_tokens=5).generate()
        all_calls = list(calls)
        calls.clear()
        os.environ[dg.ENV] = "mlp"
        mlp = GreedyDecoder(cfg, params, None, prompts=prompts, max_new_tokens=5).generate()
    finally:
        dg.gemv, dg._enabled = real, False
        os.environ.pop(dg.ENV, None)
    return cfg, base, fused, all_calls, mlp, list(calls)


def test_fused_decode_path_gives_the_same_tokens(decoders):
    cfg, (tokens, logits), (f_tokens, f_logits), _, (m_tokens, m_logits), _ = decoders
    assert f_tokens == tokens and m_tokens == tokens
    # the same roundings except silu's (two bf16 steps at most), through 2 layers
    for other in (f_logits, m_logits):
        np.testing.assert_allclose(other, logits, atol=0.05 * float(np.max(np.abs(logits))))


def test_fused_decode_path_is_four_launches_per_layer(decoders):
    cfg, _, _, calls, _, mlp_calls = decoders
    # traced once (one step shape): per layer qkv + rope, o + residual, gate_up + silu, down + residual
    assert [c[2] for c in calls] == ["rope", "residual", "silu", "residual"] * cfg.num_layers
    assert calls[0] == ((8, cfg.hidden_size), 3, "rope")
    # JAXSERVE_DECODE_GEMV=mlp: only gate_up + silu
    assert [c[2] for c in mlp_calls] == ["silu"] * cfg.num_layers
