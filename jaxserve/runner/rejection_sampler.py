"""On-device verification of speculative tokens: the target's logits at each request's K + 1 positions in,
the accepted tokens (a variable count per request, in a fixed-shape array) out.

NOTE (the rule): row r proposes ``d = num_drafts[r] <= K`` draft tokens t_0 .. t_{d-1}; the target step gave
logits at the last known token and at each draft, positions 0 .. d (the positions past d repeat position d).
Position j's target distribution p_j is the ordinary sampler's (``sampler.processed_logits``, temperature,
top-k / top-p, min-p). Greedy rows accept t_j while it is the argmax of p_j. Random rows: a proposer's draft
is a point mass (an n-gram lookup, a greedy draft model), for which the standard rejection rule (accept with
min(1, p(t) / q(t)), else draw from norm(max(0, p - q))) reads: accept t_j with probability p_j(t_j); on the
first rejection draw from p_j with t_j removed and renormalised. The accepted drafts are then followed by one
token: that draw, or on full acceptance a bonus token drawn from p_d. Each emitted token is distributed as
p given the tokens before it, as without speculation.

Randomness: the draw at position j uses the key the ordinary sampler would use for output index
num_output + j (``sampler.row_keys`` with the counter advanced by j), the acceptance test a key folded from
it: a seeded request samples reproducibly, and a row without drafts (a prompt's first token in a step where
others speculate) draws exactly what the ordinary sampler would.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.runner import packing, sampler as sampler_mod
from jaxserve.runner.sampler import SamplingMetadata

_NEG_INF = float("-inf")


class SpecOutput(NamedTuple):
    token_ids: jax.Array       # [R, K + 1] i32: the accepted drafts, then the drawn token; -1 past it
    num_tokens: jax.Array      # [R] i32: tokens emitted per row (accepted drafts + 1)
    # the last emitted token's raw logprob and rank, and the top logprobs there (rows without drafts ask for
    # these; named as the runner reads ``sampler.SamplerOutput``'s)
    logprobs: jax.Array        # [R] f32
    ranks: jax.Array           # [R] i32
    topk_ids: jax.Array        # [R, k] i32
    topk_logprobs: jax.Array   # [R, k] f32
    num_drafts: jax.Array | None = None     # [R] i32: the drafts each row verified


def per_position(meta: SamplingMetadata, width: int) -> SamplingMetadata:
    """Each row's parameters repeated for its ``width`` positions (row r, position j -> row r * width + j),
    the key counter advanced by j."""
    out = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        out[f.name] = v if v is None or f.name == "engine_key_data" else jnp.repeat(v, width, axis=0)
    offsets = jnp.tile(jnp.arange(width, dtype=jnp.uint32), meta.num_rows)
    out["key_counter"] = out["key_counter"] + offsets
    return SamplingMetadata(**out)


def rejection_sample(logits: jax.Array, meta: SamplingMetadata, draft_ids: jax.Array, num_drafts: jax.Array, *,
                     num_logprobs: int = 0, filtering: bool | None = None, bitmask: jax.Array | None = None,
                     max_candidates: int = sampler_mod.DEFAULT_MAX_CANDIDATES) -> SpecOutput:
    """Verify ``draft_ids`` [R, K] (``num_drafts`` [R] of each row are real) against ``logits`` [R * (K + 1), V]
    (row r's positions 0 .. K at rows r * (K + 1) + j). ``filtering`` and ``bitmask``: as ``sampler.sample``
    (a bitmask row applies to every position of its request)."""
    R, K = draft_ids.shape
    width = K + 1
    vocab = logits.shape[1]
    logits = logits.astype(jnp.float32)
    if bitmask is not None:
        logits = sampler_mod.apply_token_bitmask(logits, jnp.repeat(bitmask, width, axis=0))
    flat = per_position(meta, width)
    x = sampler_mod.processed_logits(logits, flat)
    greedy_ids = jnp.argmax(x, axis=1).astype(jnp.int32).reshape(R, width)
    is_greedy = meta.temperature <= 0.0
    pos = jnp.arange(K)[None, :]
    real = pos < num_drafts[:, None]                                     # [R, K]
    # a position's draft, -1 where there is none (position d, and past it)
    drafts_at = jnp.concatenate([jnp.where(real, draft_ids, -1), jnp.full((R, 1), -1, jnp.int32)], axis=1)

    def random_path(x):
        x = sampler_mod.filtered_logits(x, flat, filtering, max_candidates)
        keys = sampler_mod.row_keys(flat)
        lp = jax.nn.log_softmax(x, axis=1).reshape(R, width, vocab)
        p_draft = jnp.exp(jnp.take_along_axis(lp[:, :K], jnp.maximum(draft_ids, 0)[..., None], axis=2)[..., 0])
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (), jnp.float32))(keys)
        accept = u.reshape(R, width)[:, :K] < p_draft
        # the residual at each position: the target with that position's draft removed (none at d and past it)
        removed = drafts_at.reshape(-1)
        residual = jnp.where(jnp.arange(vocab)[None, :] == removed[:, None], _NEG_INF, x)
        # a draft the target is certain of is never rejected: its residual row (all -inf) is never read
        residual = jnp.where(jnp.isneginf(residual).all(axis=1, keepdims=True), x, residual)
        drawn = sampler_mod.sample_inverse_cdf(residual, keys).reshape(R, width)
        return accept, drawn

    def greedy_path(x):
        return jnp.zeros((R, K), bool), greedy_ids

    if filtering is None:
        accept_r, drawn = jax.lax.cond(jnp.all(is_greedy), greedy_path, random_path, x)
    else:
        accept_r, drawn = random_path(x)
    accept = jnp.where(is_greedy[:, None], draft_ids == greedy_ids[:, :K], accept_r) & real
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)      # leading accepted
    final = jnp.where(is_greedy[:, None], greedy_ids, drawn)[jnp.arange(R), num_accepted]
    cols = jnp.arange(width)[None, :]
    a = num_accepted[:, None]
    padded_drafts = jnp.concatenate([draft_ids, jnp.zeros((R, 1), jnp.int32)], axis=1)
    tokens = jnp.where(cols < a, padded_drafts, jnp.where(cols == a, final[:, None], -1)).astype(jnp.int32)
    # the logprobs of the rows that give a token only (one of each request's K + 1)
    at_final = jax.nn.log_softmax(logits.reshape(R, width, vocab)[jnp.arange(R), num_accepted], axis=1)
    return SpecOutput(tokens, (num_accepted + 1).astype(jnp.int32),
                      *sampler_mod.compute_logprobs(at_final, final, num_logprobs), num_drafts.astype(jnp.int32))


def spec_sample_fn(num_logprobs, max_rows, filtering, logits, ints, floats, bitmask=None, prev_rejected=None,
                   prev_drafts=None, prev_counts=None, *, layout):
    """The speculative step's sampler (a jitted variant): the sampling metadata, ``draft_ids``, ``num_drafts``
    and ``shift_row`` arrive packed in one int32 and one float32 buffer (``packing``). A row its forward moved
    back (``spec_shift.shift_back``: the drafts ``prev_rejected`` [max_rows] counts) draws (seeded) with
    the key counter of its true output count, as the synchronous step would. Drafts proposed on the device
    (``ngram_device``): ``num_drafts`` counts each row's draft slots, ``draft_src`` its row in the previous
    step, whose proposals ``prev_drafts`` [max_rows * K] and ``prev_counts`` [max_rows] are; a row verifies
    ``min(slots, count)`` drafts and rejects the slots past them. Returns its output and, padded to
    ``max_rows``, each row's last emitted token (as ``step_functions.sample_fn``) and its rejected drafts."""
    x = packing.unpack(ints, floats, layout)
    drafts, num_drafts, shift_row = x.pop("draft_ids"), x.pop("num_drafts"), x.pop("shift_row")
    slots = num_drafts
    if prev_drafts is not None:
        src = x.pop("draft_src")
        at = jnp.maximum(src, 0)
        drafts = prev_drafts.reshape(max_rows, -1)[at]
        num_drafts = jnp.where(src >= 0, jnp.minimum(slots, prev_counts[at]), 0)
    if prev_rejected is not None:
        shift = jnp.where((shift_row >= 0) & x["seeded"], prev_rejected[jnp.maximum(shift_row, 0)], 0)
        x["key_counter"] = x["key_counter"] - shift.astype(x["key_counter"].dtype)
    out = rejection_sample(logits, SamplingMetadata(**x), drafts, num_drafts, num_logprobs=num_logprobs,
                           filtering=filtering, bitmask=bitmask)
    last = jnp.take_along_axis(out.token_ids, (out.num_tokens - 1)[:, None], axis=1)[:, 0]
    rejected = slots - (out.num_tokens - 1)
    R = last.shape[0]
    return (out, jnp.zeros(max_rows, jnp.int32).at[:R].set(last),
            jnp.zeros(max_rows, jnp.int32).at[:R].set(rejected.astype(jnp.int32)))
