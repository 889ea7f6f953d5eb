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


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "interpret"))
def softmax_top_k(logits: jax.Array, k: int, renormalize: bool, valid: jax.Array | None = None, *,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    t, e = logits.shape
    if t > MAX_TOKENS or not 1 <= k <= e:
        raise ValueError(f"softmax_top_k: {t} tokens (at most {MAX_TOKENS}), top {k} of {e} experts")
    valid = jnp.ones((t,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    tp = _pow2(t)       # a token count of no power of two computes padded rows, sliced off (the buckets are not)
    weights, ids = pl.pallas_call(
        functools.partial(_kernel, t=t, e=e, tp=tp, ep=_pow2(e), k=k, renormalize=renormalize),
        grid=(1,),
        out_shape=(jax.ShapeDtypeStruct((tp, k), jnp.float32), jax.ShapeDtypeStruct((tp, k), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret or jax.default_backend() != "gpu", name="moe_softmax_top_k",
    )(logits, valid)
    return (weights, ids) if tp == t else (weights[:t], ids[:t])


def _kernel(logits_ref, valid_ref, weights_ref, ids_ref, *, t, e, tp, ep, k, renormalize):
    rows, cols = lax.iota(jnp.int32, tp), lax.iota(jnp.int32, ep)
    in_rows = rows < t
    inside = in_rows[:, None] & (cols < e)[None, :]
    x = plgpu.load(logits_ref.at[jnp.minimum(rows, t - 1)[:, None], jnp.minimum(cols, e - 1)[None, :]],
                   mask=inside, other=-jnp.inf).astype(jnp.float32)                          # [tp, ep]
    valid = plgpu.load(valid_ref.at[jnp.minimum(rows, t - 1)], mask=in_rows, other=0) != 0
    tops, picks = [], []
    rest = x
    for _ in range(k):                              # k is small (2-8): the maxima one after another
        top = jnp.max(rest, axis=1)                                                           # [tp]
        pick = jnp.min(jnp.where(rest == top[:, None], cols[None, :], ep), axis=1)          # lowest on ties
        rest = jnp.where(cols[None, :] == pick[:, None], -jnp.inf, rest)
        tops.append(top)
        picks.append(pick)
    shifted = [jnp.exp(v - tops[0]) for v in tops]
    if renormalize:
        total = functools.reduce(jnp.add, shifted)
    else:
        total = jnp.sum(jnp.where(inside, jnp.exp(x - tops[0][:, None]), 0.0), axis=1)
    for j in range(k):              # padded rows hold -inf logits: their weights are NaN, and are sliced off
        at = (rows, jnp.full((tp,), j, jnp.int32))
        plgpu.store(weights_ref.at[at], shifted[j] / total)
        plgpu.store(ids_ref.at[at], jnp.where(valid, picks[j], e))
