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
