"""The softmax router's top-k in one Pallas Triton launch, for decode-sized MoE steps.

``softmax_top_k(logits [T, E], k, renormalize, valid [T])`` -> ``(weights [T, k] float32, ids [T, k] int32)``:
each token's k largest logits (ties: the lower expert first, as ``lax.top_k``), their softmax weights in
float32 — over the k alone when ``renormalize`` (the softmax of the k values equals the renormalised top-k
probabilities), else ``exp(top - max) / sum(exp(all - max))`` — and a token that is not ``valid`` (padding)
routed to expert ``E`` (no expert). The same function as ``models.layers.moe.route`` plus its padding mask.

XLA compiles ``lax.top_k`` over a few rows to a sort (a key transform, the sort, a decode) and the mask and
weights to further small kernels: four or five launches a MoE layer, which at batch 1 cost more than their
work. One program holds the whole ``[T, E]`` block (decode sizes: T <= 16 tokens, E up to a few hundred
experts) and takes the k maxima one after another. Off a GPU it runs in interpret mode.

``grouped_top_k`` is the same launch for DeepSeek's routers: V3's sigmoid scores with a correction bias, and
V2's / V3's choice limited to each token's best expert groups.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_TOKENS = 64           # one program holds [T, E] in registers: a decode-sized step only


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def softmax_top_k(logits: jax.Array, k: int, renormalize: bool, valid: jax.Array | None = None, *,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The softmax router's top-k (see the module docstring)."""
    return grouped_top_k(logits, k, renormalize, valid, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "sigmoid", "num_groups", "topk_groups",
                                             "interpret"))
def grouped_top_k(logits: jax.Array, k: int, renormalize: bool, valid: jax.Array | None = None,
                  bias: jax.Array | None = None, *, sigmoid: bool = False, num_groups: int = 1, topk_groups: int = 1,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``softmax_top_k`` and DeepSeek's routers (``models.layers.moe_routing``) in the same launch:
    ``sigmoid`` scores (V3: the choice adds ``bias``, the weights are the unbiased scores of the chosen experts,
    renormalised over the k plus 1e-20), and with ``num_groups > 1`` only the experts of each token's
    ``topk_groups`` best groups compete — a group's score its best choice (softmax, V2's
    ``group_limited_greedy``) or its best two summed (sigmoid, V3's node-limited top-k), every group tied at
    the ``topk_groups``-th score kept. The weights come out before ``routed_scaling_factor``."""
    t, e = logits.shape
    if t > MAX_TOKENS or not 1 <= k <= e or e % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"grouped_top_k: {t} tokens (at most {MAX_TOKENS}), top {k} of {e} experts in "
                         f"{topk_groups} of {num_groups} groups")
    valid = jnp.ones((t,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    bias = jnp.zeros((e,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    tp = _pow2(t)       # a token count of no power of two computes padded rows, sliced off (the buckets are not)
    weights, ids = pl.pallas_call(
        functools.partial(_kernel, t=t, e=e, tp=tp, ep=_pow2(e), k=k, renormalize=renormalize, sigmoid=sigmoid,
                          groups=num_groups, topk_groups=topk_groups),
        grid=(1,),
        out_shape=(jax.ShapeDtypeStruct((tp, k), jnp.float32), jax.ShapeDtypeStruct((tp, k), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret or jax.default_backend() != "gpu", name="moe_softmax_top_k",
    )(logits, valid, bias)
    return (weights, ids) if tp == t else (weights[:t], ids[:t])


def _take_max(rest, cols, ep):
    """(each row's largest value, its lowest column, ``rest`` with that one entry set to -inf)."""
    top = jnp.max(rest, axis=1)
    pick = jnp.min(jnp.where(rest == top[:, None], cols[None, :], ep), axis=1)
    return top, pick, jnp.where(cols[None, :] == pick[:, None], -jnp.inf, rest)


def _kept_groups(choice, cols, ep, *, e, groups, topk_groups, best_two):
    """``choice`` with the experts outside each row's ``topk_groups`` best groups set to -inf."""
    member = [(cols // (e // groups) == g)[None, :] for g in range(groups)]
    scores = []
    for in_g in member:
        top, _, rest = _take_max(jnp.where(in_g, choice, -jnp.inf), cols, ep)
        scores.append(top + jnp.max(rest, axis=1) if best_two else top)
    rest = list(scores)
    for _ in range(topk_groups):        # the topk_groups-th largest score (repeats counted, as lax.top_k)
        kth = functools.reduce(jnp.maximum, rest)
        gone = jnp.zeros(kth.shape, jnp.bool_)
        for g in range(groups):
            hit = (rest[g] == kth) & jnp.logical_not(gone)
            rest[g], gone = jnp.where(hit, -jnp.inf, rest[g]), gone | hit
    keep = functools.reduce(jnp.logical_or, [(s >= kth)[:, None] & in_g for s, in_g in zip(scores, member)])
    return jnp.where(keep, choice, -jnp.inf)


def _kernel(logits_ref, valid_ref, bias_ref, weights_ref, ids_ref, *, t, e, tp, ep, k, renormalize, sigmoid, groups,
            topk_groups):
    rows, cols = lax.iota(jnp.int32, tp), lax.iota(jnp.int32, ep)
    inside = (rows < t)[:, None] & (cols < e)[None, :]
    x = plgpu.load(logits_ref.at[jnp.minimum(rows, t - 1)[:, None], jnp.minimum(cols, e - 1)[None, :]],
                   mask=inside, other=-jnp.inf).astype(jnp.float32)                          # [tp, ep]
    valid = plgpu.load(valid_ref.at[jnp.minimum(rows, t - 1)], mask=rows < t, other=0) != 0
    if sigmoid:
        scores = jnp.where(inside, jax.nn.sigmoid(x), 0.0)
        bias = plgpu.load(bias_ref.at[jnp.minimum(cols, e - 1)], mask=cols < e, other=0.0)
        choice = jnp.where(inside, scores + bias[None, :], -jnp.inf)
    else:
        choice = x
    if groups > 1:
        choice = _kept_groups(choice, cols, ep, e=e, groups=groups, topk_groups=topk_groups, best_two=sigmoid)
    tops, picks = [], []
    for _ in range(k):                              # k is small (2-8): the maxima one after another
        top, pick, choice = _take_max(choice, cols, ep)
        tops.append(top)
        picks.append(pick)
    if sigmoid:                 # the chosen experts' unbiased scores
        chosen = [jnp.sum(jnp.where(cols[None, :] == p[:, None], scores, 0.0), axis=1) for p in picks]
        weights = [w / (functools.reduce(jnp.add, chosen) + 1e-20) for w in chosen] if renormalize else chosen
    else:                       # tops[0] is the largest logit (the best group is always kept)
        shifted = [jnp.exp(v - tops[0]) for v in tops]
        if renormalize:
            total = functools.reduce(jnp.add, shifted)
        else:
            total = jnp.sum(jnp.where(inside, jnp.exp(x - tops[0][:, None]), 0.0), axis=1)
        weights = [v / total for v in shifted]
    for j in range(k):              # padded rows hold -inf logits: their weights are NaN, and are sliced off
        at = (rows, jnp.full((tp,), j, jnp.int32))
        plgpu.store(weights_ref.at[at], weights[j])
        plgpu.store(ids_ref.at[at], jnp.where(valid, picks[j], e))
