"""The MoE layer's pieces against plain definitions: routing (softmax then top-k, renormalised or not), the
grouped GEMM (every implementation, on random group sizes with empty experts and one expert holding every
row), and the whole MoE MLP against a dense every-expert loop, padding tokens routed nowhere."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import ragged_dot
from jaxserve.models.layers import moe

moe_mlp = jax.jit(moe.moe_mlp, static_argnums=(2, 3))
SPEC = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=16, renormalize=True, layers=(True,))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_is_softmax_then_top_k(renormalize, dtype):
    """HF's order (float32 softmax over every expert, top-k, renormalise) from logits in the model dtype."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), dtype)
    weights, ids = moe.route(logits, dataclasses.replace(SPEC, top_k=3, renormalize=renormalize))
    probs = _softmax(np.asarray(logits.astype(jnp.float32), np.float64))
    want_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :3]
    want = np.take_along_axis(probs, want_ids, -1)
    if renormalize:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)
    assert weights.dtype == jnp.float32


def test_route_ties_pick_the_lower_expert():
    weights, ids = moe.route(jnp.zeros((1, 8)), SPEC)
    assert np.asarray(ids).tolist() == [[0, 1]]
    np.testing.assert_allclose(np.asarray(weights), [[0.5, 0.5]])


GROUPS = [[3, 0, 5, 1, 0, 0, 2, 1], [0, 0, 12, 0, 0, 0, 0, 0], [1] * 8, [0] * 8, [2, 0, 0, 0, 0, 0, 0, 3]]


@pytest.mark.parametrize("impl", ragged_dot.IMPLEMENTATIONS)
@pytest.mark.parametrize("groups", GROUPS, ids=["mixed", "one-expert", "one-each", "none", "rows-past-groups"])
def test_grouped_matmul_matches_reference(impl, groups):
    rng = np.random.default_rng(len(groups) + sum(groups))
    m, k, n = 12, 32, 48
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((8, k, n)), jnp.float32)
    sizes = jnp.asarray(groups, jnp.int32)
    want = np.asarray(ragged_dot.grouped_matmul_reference(lhs, rhs, sizes))
    got = np.asarray(ragged_dot.grouped_matmul(lhs, rhs, sizes, impl))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert not got[sum(groups):].any(), "rows past the last group must be zero"


ROW_EXPERTS = [[3, 0, 3, 7, -1, 3, 8, 0, 5, 5, 1, 8], [2] * 12, [8] * 12, list(range(8)) + [0, 1, 2, 3]]


@pytest.mark.parametrize("experts", ROW_EXPERTS, ids=["mixed-with-unowned", "one-expert", "none", "one-each"])
def test_expert_rows_matmul_is_each_rows_own_expert(experts):
    """Rows in any order, several per expert, ids outside 0..7 (padding, another device's) giving zero."""
    rng = np.random.default_rng(len(set(experts)))
    lhs = jnp.asarray(rng.standard_normal((12, 32)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((8, 32, 48)), jnp.float32)
    got = np.asarray(ragged_dot.expert_rows_matmul(lhs, rhs, jnp.asarray(experts, jnp.int32), 12))
    for r, e in enumerate(experts):
        want = np.asarray(lhs[r] @ rhs[e]) if 0 <= e < 8 else np.zeros(48)
        np.testing.assert_allclose(got[r], want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("experts", ROW_EXPERTS + [[5, 1, 9, 5, 5, 2] * 4],
                         ids=["mixed-with-unowned", "one-expert", "none", "one-each", "m-24"])
@pytest.mark.parametrize("per", [1, 2, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_fused_rows_kernel_is_the_rows_kernel_without_its_plan(experts, per, gated):
    """One launch a product: each row ``lhs[r // per] @ rhs[expert]`` (the gate/up reads a token's state for its
    ``per`` rows), unowned rows zero, the scratch row past them ignored; the same bits as the planned kernel
    over the repeated rows. m = 24 is no power of two (DeepSeek-V2-Lite's 6 experts a token)."""
    m = len(experts)
    if m % per:
        pytest.skip("rows not a multiple of the rows per token")
    rng = np.random.default_rng(m + per)
    lhs = jnp.asarray(rng.standard_normal((m // per, 32)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((8, 32, 64)), jnp.float32)
    ids, act = jnp.asarray(experts, jnp.int32), jax.nn.silu if gated else None
    got = np.asarray(ragged_dot.expert_rows_matmul_fused(lhs, rhs, ids, m, rows_per_lhs_row=per, activation=act,
                                                         interpret=True))
    want = np.asarray(ragged_dot.expert_rows_matmul(jnp.repeat(lhs, per, axis=0), rhs, ids, m, activation=act,
                                                    interpret=True))
    assert got.shape == (m + 1, want.shape[1])
    np.testing.assert_array_equal(got[:m], want)
    assert not got[:m][[not 0 <= e < 8 for e in experts]].any()


# 5 tokens of 3 routed ids each: token 1 is padding (routed nowhere), token 3 picks expert 0 twice
SHARED_ROUTED = [[3, 0, 5], [8, 8, 8], [1, 7, 2], [0, 6, 0], [5, 2, 4]]


@pytest.mark.parametrize("shared", [1, 2, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_fused_rows_kernel_runs_the_shared_experts_in_the_same_launch(shared, gated):
    """``shared``: a token's rows are its k routed rows (the kernel without it, bit for bit), then S rows of
    the shared MLP's expert-wide slices — gate/up: columns ``s * n`` of the gate half and of the up half;
    down: rows ``s * k`` — a padding token's rows all zero. T * (k + S) = 20, 25, 30 rows: no power of two."""
    tokens, k, n = len(SHARED_ROUTED), len(SHARED_ROUTED[0]), 32
    per, rng = k + shared, np.random.default_rng(shared + 10 * gated)
    routed = jnp.asarray(SHARED_ROUTED, jnp.int32)
    rows = tokens * per
    lhs = jnp.asarray(rng.standard_normal((tokens if gated else rows + 1, 32)), jnp.float32)   # + scratch row
    rhs = jnp.asarray(rng.standard_normal((8, 32, 2 * n if gated else n)) * 0.3, jnp.float32)
    weights = jnp.asarray(rng.standard_normal((32, 2 * shared * n) if gated else (shared * 32, n)) * 0.3,
                          jnp.float32)
    act = jax.nn.silu if gated else None
    got = np.asarray(ragged_dot.expert_rows_matmul_fused(lhs, rhs, routed, tokens, rows_per_lhs_row=per if gated else 1,
                                                         activation=act, shared=weights, interpret=True))
    assert got.shape == (rows + 1, n)
    got = got[:rows].reshape(tokens, per, n)
    routed_rows = jnp.asarray(np.arange(rows).reshape(tokens, per)[:, :k].reshape(-1))
    alone = ragged_dot.expert_rows_matmul_fused(lhs[routed_rows // per] if gated else lhs[routed_rows], rhs,
                                                routed.reshape(-1), tokens * k, activation=act, interpret=True)
    np.testing.assert_array_equal(got[:, :k], np.asarray(alone[:tokens * k]).reshape(tokens, k, n))
    for t in range(tokens):
        x = lhs[t] if gated else lhs[t * per + k:(t + 1) * per]              # the token's state / its S rows
        for s in range(shared):
            if gated:
                gate, up = x @ weights[:, s * n:(s + 1) * n], x @ weights[:, (shared + s) * n:(shared + s + 1) * n]
                want = jax.nn.silu(gate) * up
            else:
                want = x[s] @ weights[s * 32:(s + 1) * 32]
            want = np.zeros(n) if SHARED_ROUTED[t][0] == 8 else np.asarray(want)
            np.testing.assert_allclose(got[t, k + s], want, atol=1e-5, rtol=1e-5)
    assert not got[1].any()
    with pytest.raises(ValueError, match="are not experts of"):
        ragged_dot.expert_rows_matmul_fused(lhs, rhs, routed, tokens, activation=act, shared=weights[:, :-16],
                                            interpret=True)


def test_gather_plan_reads_each_expert_once_and_covers_every_row():
    experts = jnp.asarray([3, 0, 3, 7, 9, 3, 0], jnp.int32)
    group, index, num_rows = (np.asarray(a) for a in ragged_dot.gather_plan(experts, 8, 16))
    index = index.reshape(7, 16)
    live = np.flatnonzero(num_rows)
    assert sorted(group[live].tolist()) == [0, 3, 7]                       # one live tile per distinct expert
    for t in live:
        assert index[t, :num_rows[t]].tolist() == [r for r in range(7) if experts[r] == group[t]]
        assert (index[t, num_rows[t]:] == 7).all()                          # the rest name the zero row
    assert (index[num_rows == 0] == 7).all()
    plan = jax.jit(lambda e: ragged_dot.gather_plan(e, 8, 16)).lower(experts).compile().as_text()
    assert " while(" not in plan


def test_reference_is_each_groups_product():
    rng = np.random.default_rng(0)
    lhs, rhs = jnp.asarray(rng.standard_normal((9, 16))), jnp.asarray(rng.standard_normal((3, 16, 8)))
    out = np.asarray(ragged_dot.grouped_matmul_reference(lhs, rhs, jnp.asarray([3, 0, 5])))
    np.testing.assert_allclose(out[:3], lhs[:3] @ rhs[0], rtol=1e-6)
    np.testing.assert_allclose(out[3:8], lhs[3:8] @ rhs[2], rtol=1e-6)
    assert not out[8:].any()


def test_tile_plan_covers_every_row_once():
    sizes = jnp.asarray([17, 0, 1, 32, 0, 5], jnp.int32)
    group, row0, rows = (np.asarray(a) for a in ragged_dot.tile_plan(sizes, 55, 16))
    covered = np.concatenate([np.arange(r0, r0 + n) for r0, n in zip(row0, rows) if n])
    assert sorted(covered.tolist()) == list(range(55))
    ends = np.cumsum(np.asarray(sizes))
    for g, r0, n in zip(group, row0, rows):      # a tile never crosses into another group's rows
        if n:
            assert ends[g] - np.asarray(sizes)[g] <= r0 and r0 + n <= ends[g]


def _weights(spec, hidden=32, seed=0):
    rng = np.random.default_rng(seed)
    e, i = spec.num_experts, spec.intermediate_size
    w = {"router": rng.standard_normal((hidden, e)), "experts_gate_up": rng.standard_normal((e, hidden, 2, i)) * 0.2,
         "experts_down": rng.standard_normal((e, i, hidden)) * 0.2}
    if spec.shared_intermediate_size:
        si = spec.shared_intermediate_size
        w |= {"shared_gate_up": rng.standard_normal((hidden, 2, si)) * 0.2,
              "shared_down": rng.standard_normal((si, hidden)) * 0.2, "shared_gate": rng.standard_normal((hidden, 1))}
    return {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}


def _dense_reference(h, w, spec):
    """Every expert on every token, each token keeping its top-k experts' outputs times their weights."""
    h = np.asarray(h, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    probs = _softmax(h @ w["router"])
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :spec.top_k]
    top = np.take_along_axis(probs, ids, -1)
    if spec.renormalize:
        top = top / top.sum(-1, keepdims=True)
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j, e in enumerate(ids[t]):
            gu = np.einsum("h,hci->ci", h[t], w["experts_gate_up"][e])
            out[t] += top[t, j] * ((silu(gu[0]) * gu[1]) @ w["experts_down"][e])
    if spec.shared_intermediate_size:
        gu = np.einsum("th,hci->tci", h, w["shared_gate_up"])
        gate = 1 / (1 + np.exp(-(h @ w["shared_gate"])))
        out += gate * ((silu(gu[:, 0]) * gu[:, 1]) @ w["shared_down"])
    return out


@pytest.mark.parametrize("impl", ragged_dot.IMPLEMENTATIONS + ("rows", "rows_fused"))
@pytest.mark.parametrize("kind", ["mixtral", "qwen2-shared"])
def test_moe_mlp_matches_dense_every_expert_loop(impl, kind):
    spec = _with_impl(SPEC, impl)
    if kind == "qwen2-shared":
        spec = dataclasses.replace(spec, top_k=4, renormalize=False, weights_in_hidden_dtype=True,
                                   shared_intermediate_size=24)
    w = _weights(spec)
    h = jnp.asarray(np.random.default_rng(1).standard_normal((6, 32)), jnp.float32)
    out, _ = moe_mlp(h, w, spec, jax.nn.silu)
    np.testing.assert_allclose(np.asarray(out), _dense_reference(h, w, spec), atol=1e-4, rtol=1e-4)


def _with_impl(spec, impl):
    """``rows``: the sort-free decode kernel (Pallas, interpreted here) up to 16 tokens, the Pallas grouped GEMM
    above; ``rows_fused``: the same in one launch a product."""
    if impl in ("rows", "rows_fused"):
        return dataclasses.replace(spec, grouped_gemm="pallas", rows_path_max_tokens=moe.ROWS_PATH_MAX_TOKENS,
                                   rows_fused=impl == "rows_fused")
    return dataclasses.replace(spec, grouped_gemm=impl)


@pytest.mark.parametrize("impl", ["ragged_dot", "rows", "rows_fused"])
def test_padding_tokens_reach_no_expert(impl):
    spec = _with_impl(SPEC, impl)
    w = _weights(spec)
    h = jnp.asarray(np.random.default_rng(2).standard_normal((4, 32)), jnp.float32)
    valid = jnp.asarray([True, True, False, False])
    out, ids = moe_mlp(h, w, spec, jax.nn.silu, valid)
    out = np.asarray(out)
    assert not out[2:].any()
    np.testing.assert_allclose(out[:2], _dense_reference(h[:2], w, spec), atol=1e-4, rtol=1e-4)
    load = moe.expert_load(ids[None], spec.num_experts)
    assert int(np.asarray(load).sum()) == 2 * spec.top_k, "padding tokens must not count in the expert load"


SHARED_KINDS = {"deepseek-v2": dict(router="deepseek_v2", renormalize=False, routed_scaling_factor=1.5),
                "deepseek-v3": dict(router="deepseek_v3", top_k=3, num_groups=4, topk_groups=2),
                "qwen2-shared": dict(top_k=4, renormalize=False, weights_in_hidden_dtype=True)}


@pytest.mark.parametrize("kind", sorted(SHARED_KINDS))
def test_rows_fused_runs_the_shared_expert_with_the_routed_ones(kind):
    """``rows_fused``: the shared expert rides in the routed experts' two launches, no product of its own in
    the step — DeepSeek's ungated shared experts (2 experts wide; V2's softmax router, V3's sigmoid one) and
    Qwen2-MoE's gated one (3 wide, its sigmoid the combine weight) — and equals the separate computation on
    the real tokens; padding tokens come out zero and count in no expert's load. A shared MLP of no whole
    number of experts, or expert parallelism, keeps the separate products."""
    gated = kind == "qwen2-shared"
    spec = dataclasses.replace(_with_impl(SPEC, "rows_fused"), shared_intermediate_size=(3 if gated else 2) * 16,
                               shared_expert_gate=gated, **SHARED_KINDS[kind])
    w = _weights(spec, seed=6)
    if kind == "deepseek-v3":
        w["router_bias"] = jnp.asarray(np.random.default_rng(7).standard_normal(8) * 0.1, jnp.float32)
    h = jnp.asarray(np.random.default_rng(8).standard_normal((7, 32)), jnp.float32)
    valid = np.asarray([True, True, False, True, True, False, True])
    out, ids = moe_mlp(h, w, spec, jax.nn.silu, jnp.asarray(valid))
    want, want_ids = moe_mlp(h, w, dataclasses.replace(spec, rows_fused=False), jax.nn.silu, jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))         # the routed ids [T, k] alone
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(want)[valid], atol=1e-5, rtol=1e-5)
    assert not np.asarray(out)[~valid].any()
    assert int(np.asarray(moe.expert_load(ids[None], 8)).sum()) == valid.sum() * spec.top_k

    def products(spec, w):       # matmuls outside the Pallas kernels
        jaxpr = jax.make_jaxpr(moe.moe_mlp, static_argnums=(2, 3))(h, w, spec, jax.nn.silu, jnp.asarray(valid))
        return _dots_outside_kernels(jaxpr.jaxpr)

    router = 2 if gated else 1         # the router's logits, Qwen2-MoE's shared gate
    assert products(spec, w) == router
    assert products(dataclasses.replace(spec, expert_parallel=True), w) == router + 2
    odd = dataclasses.replace(spec, shared_intermediate_size=40)
    assert products(odd, _weights(odd)) == router + 2


def _dots_outside_kernels(jaxpr) -> int:
    from jax.extend.core import jaxprs_in_params

    return sum(int(eqn.primitive.name == "dot_general") + sum(_dots_outside_kernels(sub) for sub in
               jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns if eqn.primitive.name != "pallas_call")


@pytest.mark.parametrize("impl", ["rows", "rows_fused"])
def test_rows_path_runs_only_at_decode_sizes(impl):
    """16 tokens (one expert may get 16 rows: a full tile) take the rows path, 17 the sorted one; both
    match the dense loop."""
    spec = _with_impl(dataclasses.replace(SPEC, num_experts=4), impl)
    w = _weights(spec, seed=4)
    for t in (16, 17):
        h = jnp.asarray(np.random.default_rng(t).standard_normal((t, 32)), jnp.float32)
        out, _ = moe_mlp(h, w, spec, jax.nn.silu)
        np.testing.assert_allclose(np.asarray(out), _dense_reference(h, w, spec), atol=1e-4, rtol=1e-4)
    lowered = {t: moe_mlp.lower(jnp.zeros((t, 32)), w, spec, jax.nn.silu).as_text() for t in (16, 17)}
    assert "stablehlo.sort" not in lowered[16] and "stablehlo.sort" in lowered[17]


def test_expert_load_counts_each_tokens_top_k():
    """The load histogram of two layers' routing against numpy's: every real token once per expert among its
    top-k, per layer."""
    w = _weights(SPEC)
    valid = np.arange(9) < 7
    ids, want = [], []
    for seed in (4, 5):
        h = jnp.asarray(np.random.default_rng(seed).standard_normal((9, 32)), jnp.float32)
        ids.append(moe_mlp(h, w, SPEC, jax.nn.silu, jnp.asarray(valid))[1])
        logits = np.asarray(h, np.float64) @ np.asarray(w["router"], np.float64)
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :SPEC.top_k][valid]
        want.append(np.bincount(top.reshape(-1), minlength=SPEC.num_experts))
    load = jax.jit(moe.expert_load, static_argnums=1)(jnp.stack(ids), SPEC.num_experts)
    np.testing.assert_array_equal(np.asarray(load), np.stack(want))
    assert load.dtype == jnp.int32


def test_layers_follow_hf_sparse_step_and_mlp_only_layers():
    from jaxserve.config import ModelConfig

    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=6, num_heads=1, num_kv_heads=1, head_dim=8, model_type="qwen3_moe",
                      extra=(("decoder_sparse_step", 2), ("mlp_only_layers", (3,)), ("moe_intermediate_size", 4),
                             ("num_experts", 4), ("num_experts_per_tok", 2)))
    spec = moe.moe_spec(cfg, renormalize=True, weights_in_hidden_dtype=True)
    assert spec.layers == (False, True, False, False, False, True)
    assert not spec.expert_parallel and moe.moe_spec(moe.with_expert_parallel(cfg, True), renormalize=True,
                                                     weights_in_hidden_dtype=True).expert_parallel


def test_grouped_gemm_switch_picks_the_path_and_refuses_other_names(monkeypatch):
    """``JAXSERVE_MOE_GROUPED_GEMM``: auto is ``ragged_dot`` off a GPU, ``rows`` the Pallas kernel with the
    sort-free path at decode sizes, a ragged_dot implementation that alone; any other name stops the spec
    naming the values it takes."""
    from jaxserve.config import ModelConfig

    cfg = ModelConfig(architecture="MixtralForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, model_type="mixtral",
                      extra=(("moe_intermediate_size", 4), ("num_experts", 4), ("num_experts_per_tok", 2)))

    def spec(value):
        monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", value)
        s = moe.moe_spec(cfg, renormalize=True, weights_in_hidden_dtype=False)
        return s.grouped_gemm, s.rows_path_max_tokens, s.rows_fused

    assert spec("auto") == ("ragged_dot", 0, False)                      # tests run on CPU
    assert spec("rows") == ("pallas", moe.ROWS_PATH_MAX_TOKENS, False)
    assert spec("rows_fused") == ("pallas", moe.ROWS_PATH_MAX_TOKENS, True)
    assert spec("gather") == ("gather", 0, False)
    with pytest.raises(ValueError, match="MOE_GROUPED_GEMM='fused' is not one of auto, rows, rows_fused, ragged_dot"):
        spec("fused")


def test_pallas_tiles_larger_than_groups_and_spanning_them():
    """Tiles of 32 rows over groups of 20, 0, 33 and 7 rows (a group split over tiles, tiles cut short)."""
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.float32)
    sizes = jnp.asarray([20, 0, 33, 7], jnp.int32)
    got = ragged_dot.grouped_matmul_pallas(lhs, rhs, sizes, block_m=32, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ragged_dot.grouped_matmul_reference(lhs, rhs, sizes)),
                               atol=1e-4, rtol=1e-5)


GATED = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


@pytest.mark.parametrize("activation", sorted(GATED))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_kernel_matches_the_gated_reference(activation, dtype):
    """The gate/up product gated inside the Pallas kernel (interpreted), both ways it runs (sorted groups, and
    rows in token order with unowned ones), equals ``gated`` of the plain reference product; uncovered rows
    stay zero. The gate and up columns are 48 apart, so a block that read the wrong half would show."""
    act = GATED[activation]
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.standard_normal((12, 32)), dtype)
    rhs = jnp.asarray(rng.standard_normal((8, 32, 2 * 48)) * 0.3, dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == "float32" else dict(atol=0.1, rtol=0.02)
    sizes = jnp.asarray(GROUPS[0], jnp.int32)
    want = ragged_dot.gated(ragged_dot.grouped_matmul_reference(lhs, rhs, sizes), act)
    got = ragged_dot.grouped_matmul_pallas(lhs, rhs, sizes, activation=act, interpret=True)
    assert got.shape == (12, 48) and got.dtype == lhs.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    assert not np.asarray(got[sum(GROUPS[0]):], np.float32).any()
    experts = jnp.asarray(ROW_EXPERTS[0], jnp.int32)
    got = np.asarray(ragged_dot.expert_rows_matmul(lhs, rhs, experts, 12, activation=act, interpret=True), np.float32)
    for r, e in enumerate(ROW_EXPERTS[0]):
        want = ragged_dot.gated((lhs[r:r + 1] @ rhs[e]).astype(lhs.dtype), act) if 0 <= e < 8 else np.zeros((1, 48))
        np.testing.assert_allclose(got[r:r + 1], np.asarray(want, np.float32), **tol)


@pytest.mark.parametrize("impl", ["ragged_dot", "gather"])
def test_moe_layer_compiles_to_no_device_loop(impl):
    """A ``while`` in the step costs a launch (on GPU a host round trip) per iteration, in every MoE layer;
    the routing, sort and tile plan must be loop-free (the Pallas kernel's own loop runs inside its launch,
    so the plan is checked on its own)."""
    spec = dataclasses.replace(SPEC, grouped_gemm=impl)
    w = _weights(spec)
    h = jnp.zeros((6, 32), jnp.float32)
    hlo = moe_mlp.lower(h, w, spec, jax.nn.silu, jnp.ones((6,), bool)).compile().as_text()
    assert " while(" not in hlo
    plan = jax.jit(lambda s: ragged_dot.tile_plan(s, 64, 16)).lower(jnp.ones((8,), jnp.int32)).compile().as_text()
    assert " while(" not in plan

