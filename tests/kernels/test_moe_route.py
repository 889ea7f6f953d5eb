"""kernels/moe_route.softmax_top_k (interpret mode here) against the MoE layer's own routing (``moe.route``) and
its padding mask: the same experts in the same order (ties to the lower expert), the same float32 weights."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import moe_route
from jaxserve.models.layers import moe


@pytest.mark.parametrize("tokens,experts,top_k", [(4, 128, 8), (1, 64, 6), (16, 8, 2), (6, 60, 4), (3, 7, 7)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top_k_matches_the_layers_routing(tokens, experts, top_k, renormalize, dtype):
    rng = np.random.default_rng(tokens * experts + top_k)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)) * 3, dtype)
    valid = jnp.asarray(np.arange(tokens) % 3 != 2)
    spec = moe.MoESpec(num_experts=experts, top_k=top_k, intermediate_size=16, renormalize=renormalize)
    want_w, want_ids = moe.route(logits, spec)
    weights, ids = moe_route.softmax_top_k(logits, top_k, renormalize, valid, interpret=True)
    assert weights.shape == (tokens, top_k) and weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), np.where(np.asarray(valid)[:, None], want_ids, experts))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-6, atol=1e-7)


def test_ties_pick_the_lower_expert_and_all_tokens_valid_by_default():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], jnp.float32)
    weights, ids = moe_route.softmax_top_k(logits, 3, True, interpret=True)
    assert np.asarray(ids).tolist() == [[1, 2, 4], [0, 1, 2]]
    np.testing.assert_allclose(np.asarray(weights), np.full((2, 3), 1 / 3), rtol=1e-6)


def test_refuses_more_than_a_decode_step_or_k_past_the_experts():
    with pytest.raises(ValueError, match="at most 64"):
        moe_route.softmax_top_k(jnp.zeros((65, 8)), 2, True, interpret=True)
    with pytest.raises(ValueError, match="top 9 of 8"):
        moe_route.softmax_top_k(jnp.zeros((4, 8)), 9, True, interpret=True)


@pytest.mark.parametrize("router,groups,topk_groups,top_k,renormalize", [
    ("deepseek_v2", 8, 3, 6, False),          # V2's group_limited_greedy
    ("deepseek_v2", 1, 1, 6, False),          # V2-Lite's greedy
    ("deepseek_v3", 8, 4, 8, True),           # V3's node-limited top-k on sigmoid scores plus bias
    ("deepseek_v3", 4, 2, 4, False),
    ("deepseek_v3", 1, 1, 8, True)])
@pytest.mark.parametrize("tokens", [4, 5])
def test_grouped_top_k_matches_deepseeks_routers(router, groups, topk_groups, top_k, renormalize, tokens):
    from jaxserve.models.layers import moe_routing
    experts, hidden = 64, 32
    rng = np.random.default_rng(groups * 10 + top_k + tokens)
    h = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    router_w = jnp.asarray(rng.standard_normal((hidden, experts)) * 0.3, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(experts) * 0.1, jnp.float32) if router == "deepseek_v3" else None
    spec = moe.MoESpec(num_experts=experts, top_k=top_k, intermediate_size=16, renormalize=renormalize,
                       router=router, num_groups=groups, topk_groups=topk_groups)
    want_w, want_ids = moe_routing.route(h, router_w, bias, spec)
    valid = jnp.asarray(np.arange(tokens) != 1)
    weights, ids = moe_route.grouped_top_k(moe_routing.router_logits(h, router_w), top_k, renormalize, valid, bias,
                                           sigmoid=router == "deepseek_v3", num_groups=groups,
                                           topk_groups=topk_groups, interpret=True)
    want_ids = np.where(np.asarray(valid)[:, None], np.asarray(want_ids), experts)
    # the same experts (lax.top_k and the kernel both order them by choice, ties to the lower expert)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-7)


def test_tied_groups_are_all_kept():
    """Two groups tied at the kept-last score both stay in (moe_routing's rule), so the top-2 may come from
    either: here the best expert of group 2 beats group 1's second best."""
    logits = jnp.asarray([[5.0, 0.0, 3.0, 1.0, 3.0, 2.9, -1.0, -2.0]], jnp.float32)   # groups of 2
    _, ids = moe_route.grouped_top_k(logits, 3, True, num_groups=4, topk_groups=2, interpret=True)
    assert np.asarray(ids).tolist() == [[0, 2, 4]]
