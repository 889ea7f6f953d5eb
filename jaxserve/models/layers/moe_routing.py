"""DeepSeekMoE's routers, as HF transformers computes them (``layers.moe`` runs the experts they pick).

Both take the router logits in float32 (float32 products and sums of the hidden state and the router weight)
and return ``(weights [T, k] float32, expert ids [T, k] int32)``, the weights already times
``routed_scaling_factor``:

- ``deepseek_v2``: softmax scores; ``greedy`` is their top-k; ``group_limited_greedy`` (``num_groups > 1``)
  first keeps the ``topk_groups`` groups with the largest best score and zeroes the other groups' scores.
  The top-k scores are the weights (never renormalised: transformers' DeepseekV2 does not).
- ``deepseek_v3``: sigmoid scores; the choice adds ``e_score_correction_bias``; node-limited top-k keeps the
  ``topk_groups`` groups whose two best biased scores sum highest and masks the rest to -inf; the weights are
  the unbiased scores of the chosen experts, divided by their sum (plus 1e-20) when ``norm_topk_prob``.

All of it is a few small fused ops inside the jitted step (no host work, no ``lax.cond``); the order of the
k ids differs from torch's ``sorted=False``, which changes nothing (the combine sums over them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

ROUTERS = ("deepseek_v2", "deepseek_v3")
BIASED = ("deepseek_v3",)          # routers with a per-expert correction bias (a weight of the layer)


def _keep_groups(group_scores: jax.Array, topk_groups: int) -> jax.Array:
    """``[T, G]`` bool: each token's ``topk_groups`` best groups (``group_scores [T, G]``): those scoring at
    least the ``topk_groups``-th best, one comparison that fuses with the masking that reads it. A tie at that
    score keeps every tied group (top-k's own order among ties is arbitrary, torch's included)."""
    kth = lax.top_k(group_scores, topk_groups)[0][:, topk_groups - 1:]
    return group_scores >= kth


def _mask_groups(x: jax.Array, keep: jax.Array, fill: float) -> jax.Array:
    """``x [T, E]`` with the experts of the groups ``keep [T, G]`` leaves out set to ``fill``."""
    t, e = x.shape
    g = keep.shape[1]
    return jnp.where(keep[:, :, None], x.reshape(t, g, e // g), fill).reshape(t, e)


def router_logits(h: jax.Array, router: jax.Array) -> jax.Array:
    """``[T, E]`` float32: float32 products and sums of the inputs as they are (bf16 products are exact in
    float32, so this is HF's widen-then-multiply without a float32 copy of the hidden state and the router
    weight each step)."""
    return jnp.dot(h, router, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def route(h: jax.Array, router: jax.Array, bias: jax.Array | None, spec) -> tuple[jax.Array, jax.Array]:
    """The routing of ``h [T, hidden]`` by ``router [hidden, E]`` (``spec``: a ``moe.MoESpec``)."""
    logits = router_logits(h, router)
    t, e = logits.shape
    g = spec.num_groups
    if spec.router == "deepseek_v2":
        # softmax is monotone: the group maxima and the top-k of the logits pick what the scores' would, and
        # the chosen weights are their softmax values, exp(top - max) / sum(exp(logits - max))
        choice = logits
        if g > 1:
            choice = _mask_groups(logits, _keep_groups(logits.reshape(t, g, e // g).max(-1), spec.topk_groups),
                                  -jnp.inf)
        top, ids = lax.top_k(choice, spec.top_k)
        biggest = top[:, :1]            # the best group is always kept, so this is the largest logit
        weights = jnp.exp(top - biggest) / jnp.sum(jnp.exp(logits - biggest), axis=-1, keepdims=True)
    elif spec.router == "deepseek_v3":
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(jnp.float32)
        if g > 1:
            best2 = lax.top_k(choice.reshape(t, g, e // g), 2)[0]
            choice = _mask_groups(choice, _keep_groups(best2[..., 0] + best2[..., 1], spec.topk_groups), -jnp.inf)
        _, ids = lax.top_k(choice, spec.top_k)
        # top-k's ids are in bounds: a bare gather, no clamping or negative-index wrap
        weights = jnp.take_along_axis(scores, ids, axis=1, mode="promise_in_bounds", wrap_negative_indices=False)
        if spec.renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        raise ValueError(f"unknown MoE router {spec.router!r}; one of softmax, {', '.join(ROUTERS)}")
    if spec.routed_scaling_factor != 1.0:          # V2-Lite's is 1: no multiply
        weights = weights * spec.routed_scaling_factor
    return weights, ids.astype(jnp.int32)
