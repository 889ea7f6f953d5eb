"""DeepSeekMoE's routers, as HF transformers computes them (``layers.moe`` runs the experts they pick).

Both take the router logits in float32 (the hidden state and the router weight widened first) and return
``(weights [T, k] float32, expert ids [T, k] int32)``, the weights already times ``routed_scaling_factor``:

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


def _keep_groups(group_scores: jax.Array, topk_groups: int, experts_per_group: int) -> jax.Array:
    """``[T, E]`` bool: the experts of each token's ``topk_groups`` best groups (``group_scores [T, G]``)."""
    _, groups = lax.top_k(group_scores, topk_groups)
    keep = jnp.sum(jax.nn.one_hot(groups, group_scores.shape[1], dtype=jnp.int32), axis=1) > 0
    return jnp.repeat(keep, experts_per_group, axis=1)


def route(h: jax.Array, router: jax.Array, bias: jax.Array | None, spec) -> tuple[jax.Array, jax.Array]:
    """The routing of ``h [T, hidden]`` by ``router [hidden, E]`` (``spec``: a ``moe.MoESpec``)."""
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    t, e = logits.shape
    g = spec.num_groups
    if spec.router == "deepseek_v2":
        scores = jax.nn.softmax(logits, axis=-1)
        if g > 1:
            keep = _keep_groups(scores.reshape(t, g, e // g).max(-1), spec.topk_groups, e // g)
            scores = jnp.where(keep, scores, 0.0)
        weights, ids = lax.top_k(scores, spec.top_k)
    elif spec.router == "deepseek_v3":
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(jnp.float32)
        group_scores = lax.top_k(choice.reshape(t, g, e // g), 2)[0].sum(-1)
        choice = jnp.where(_keep_groups(group_scores, spec.topk_groups, e // g), choice, -jnp.inf)
        _, ids = lax.top_k(choice, spec.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=1)
        if spec.renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        raise ValueError(f"unknown MoE router {spec.router!r}; one of softmax, {', '.join(ROUTERS)}")
    return weights * spec.routed_scaling_factor, ids.astype(jnp.int32)
