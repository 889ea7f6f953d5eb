"""Flash-decoding: into how many splits a decode's KV axis goes, and the kernel that merges the splits'
softmax states into the output (``ragged_paged_attention``'s decode tiles write one state per split)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .device_info import num_sms
from .triton_rows import next_pow2, store_rows


def pick_splits(num_reqs: int, kv_heads: int, max_ctx: int, block_k: int) -> int:
    """Flash-decoding splits: enough (request, head, split) programs for ~4 waves, each split >= 4 chunks and
    >= 512 keys (below that the combine becomes the cost)."""
    want = max(1, (4 * num_sms()) // max(1, num_reqs * kv_heads))
    cap = max(1, max_ctx // (4 * max(block_k, 128)))
    return max(1, min(next_pow2(want), next_pow2(cap) if cap > 1 else 1))


def _combine_kernel(qsl_ref, seq_lens_ref, num_seqs_ref, vs_ref, o_ref, m_ref, l_ref, *out_refs,
                    group, group_pad, num_splits, num_q_heads):
    """Merge the splits' softmax states of request r's decode token for kv head h (flash-decoding).
    ``out_refs``: the output, after the aliased output buffer when one comes in."""
    out_ref = out_refs[-1]
    r, h = pl.program_id(0), pl.program_id(1)
    tok = qsl_ref[r]
    seq_len = seq_lens_ref[r]
    active = (r < num_seqs_ref[0]) & (qsl_ref[r + 1] - tok == 1) & (seq_len > 0)
    num_reqs = seq_lens_ref.shape[0]
    d = o_ref.shape[1]
    s = lax.iota(jnp.int32, num_splits)
    g = lax.iota(jnp.int32, group_pad)
    # Padded head slots (g >= group) re-read the last real head: in bounds, never stored.
    part = (s[:, None] * num_reqs + r) * num_q_heads + h * group + jnp.minimum(g, group - 1)[None, :]
    m = plgpu.load(m_ref.at[part])                                          # [S, G]
    l = plgpu.load(l_ref.at[part])
    cols = lax.iota(jnp.int32, d)
    o = plgpu.load(o_ref.at[part[:, :, None], cols[None, None, :]])         # [S, G, D]
    m_all = m.max(axis=0)
    w = jnp.exp2(m - m_all[None, :])
    l_all = (w * l).sum(axis=0)
    acc = (w[:, :, None] * o).sum(axis=0)                                   # [G, D]
    out = acc * (vs_ref[h] / jnp.where(l_all > 0, l_all, 1.0))[:, None]
    store_rows(out_ref, tok * num_q_heads + h * group + g, out, active & (g < group))


def combine(qsl, seq_lens, num_seqs, v_scale, parts, outs, *, out_shape, grid, num_splits, group, group_pad,
            num_q_heads, interpret):
    """The merged decode rows: written into ``outs[0]`` (aliased) when given, else a new ``out_shape`` array."""
    o_parts, m_parts, l_parts = parts
    return pl.pallas_call(
        functools.partial(_combine_kernel, group=group, group_pad=group_pad, num_splits=num_splits,
                          num_q_heads=num_q_heads),
        grid=grid, out_shape=out_shape, input_output_aliases={7: 0} if outs else {},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="ragged_paged_combine")(qsl, seq_lens, num_seqs, v_scale, o_parts, m_parts, l_parts, *outs)
