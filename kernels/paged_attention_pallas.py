"""Ragged paged attention for NVIDIA GPUs in Pallas (Triton lowering).

Same function as ``ref_attention.ragged_paged_attention`` over the engine's cache layout
``[num_blocks, block_size, kv_heads, head_dim]``; ``k_scale``/``v_scale`` dequantize an fp8 cache.

Two launches share one kernel body and one output buffer (chained through ``input_output_aliases``):

* the **prefill** launch walks q-blocks of ``block_q`` tokens of requests with ``q_len > 1``; a tile is
  ``block_q * group`` rows (tokens x the q heads of one kv head), so one K/V read serves the whole GQA
  group; causal masking and sliding window come from each row's absolute position;
* the **decode** launch takes requests with ``q_len == 1``, one tile per (request, kv head), and splits the
  KV axis ``num_splits`` ways (flash-decoding) when there are too few (request, head) pairs to fill the
  chip; the partial softmax states are merged in XLA.

Both read K/V a page-row at a time: token ``pos`` of request ``r`` lives in flat row
``(block_tables[r, pos // block_size] * block_size + pos % block_size) * kv_heads + h`` of the cache seen as
``[num_blocks * block_size * kv_heads, head_dim]`` -- a gather of contiguous ``head_dim`` rows, which the
Triton lowering turns into vectorised pointer loads, pipelined over ``num_stages``.

Why Triton and not Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``): the work here is a gather through
block tables.  Triton expresses it as pointer arithmetic on any page size and layout, compiles on the
jaxlib we pin, and runs in interpret mode on CPU for the tests.  Mosaic GPU wants TMA copies of whole
tiles whose addresses are known per copy; a 16-token page of one kv head is a 4 KiB strided box, so a
Mosaic GPU kernel needs one small TMA per page (or a cache layout change the model code does not want)
and its own warp-specialised pipeline.  The benchmark (benchmarks/kernels_bench.py) times ours against
the stock Triton paged kernel and against Mosaic GPU's stock flash attention on the prefill shape; those
figures, in benchmarks/results/, are the measurement behind this choice: decode is memory-bound and the
Triton gather kernel reaches most of the bandwidth ceiling, so Mosaic GPU's advantage (wgmma + TMA) only
matters for the compute-bound prefill, where we record the gap rather than hide it.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .metadata import AttentionMetadata
from .ref_attention import head_scale

# Finite, so a fully masked chunk gives exp2(MASK - MASK) = 1 instead of NaN; such a row's garbage is
# wiped by the first real chunk (its correction factor is exp2(MASK - m_real) = 0) and rows that never
# see a real key are padding rows, which are never stored.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)
NUM_SMS = 132  # H200; only used to pick the decode split count


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kv_loop(q, q_pos, row_valid, r, kv_lo, kv_hi, k_ref, v_ref, bt_ref, k_scale, *, h, kv_heads,
             block_size, pages_per_seq, block_k, sm_scale, soft_cap, sliding_window):
    """Online softmax of tile ``q [M, D]`` over the request's keys ``[kv_lo, kv_hi)`` in steps of block_k.

    Returns the unnormalised accumulator ``[M, D]`` f32 and the running max / sum ``[M]`` (base 2).
    """
    m_rows, d = q.shape
    offs = lax.iota(jnp.int32, block_k)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        pos = kv_lo + i * block_k + offs                                      # [BK]
        in_range = pos < kv_hi
        page = jnp.minimum(pos // block_size, pages_per_seq - 1)
        blk = bt_ref[r * pages_per_seq + page]                                # [BK]
        rows = (blk * block_size + pos % block_size) * kv_heads + h
        ld_mask = jnp.broadcast_to(in_range[:, None], (block_k, d))
        zero = jnp.zeros((), k_ref.dtype)
        k = plgpu.load(_rows(k_ref, rows), mask=ld_mask, other=zero)               # [BK, D]
        v = plgpu.load(_rows(v_ref, rows), mask=ld_mask, other=zero)
        if k.dtype != q.dtype:                                                # fp8 cache
            k = k.astype(q.dtype)
            v = v.astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * (sm_scale * k_scale)                 # [M, BK] f32
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = s * LOG2E
        mask = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
        if sliding_window is not None:
            mask &= pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_prev * alpha + p.sum(axis=-1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
        return acc, m_new, l_new

    n_iter = jnp.maximum(pl.cdiv(kv_hi - kv_lo, block_k), 0)
    init = (jnp.zeros((m_rows, d), jnp.float32), jnp.full((m_rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    del row_valid
    return lax.fori_loop(0, n_iter, body, init)


def _rows(ref, rows):
    """View of whole rows ``rows [N]`` of a 2-D ref: ``[N, ref.shape[1]]`` (a gather of contiguous rows).

    Spelled as two broadcast index arrays (not rows + slice) so interpret mode can discharge it too.
    """
    cols = lax.iota(jnp.int32, ref.shape[1])
    return ref.at[rows[:, None], cols[None, :]]


def _window_lo(first_q_pos, sliding_window, block_k):
    if sliding_window is None:
        return jnp.int32(0)
    lo = jnp.maximum(first_q_pos - sliding_window + 1, 0)
    return (lo // block_k) * block_k


def _prefill_kernel(qb_req_ref, qb_start_ref, qsl_ref, seq_lens_ref, bt_ref, ks_ref, vs_ref, q_ref,
                    k_ref, v_ref, _out_in_ref, out_ref, *, group, group_pad, block_q, **kw):
    qb, h = pl.program_id(0), pl.program_id(1)
    r = qb_req_ref[qb]
    start = qb_start_ref[qb]                      # first token of the tile; < 0 marks an idle program
    q_end = qsl_ref[r + 1]
    seq_len = seq_lens_ref[r]
    num_q_heads = group * kw["kv_heads"]
    i = lax.iota(jnp.int32, block_q * group_pad)
    tok = start + i // group_pad
    g = i % group_pad
    row_valid = (start >= 0) & (tok < q_end) & (g < group)
    q_rows = tok * num_q_heads + h * group + g
    q = plgpu.load(_rows(q_ref, q_rows), mask=jnp.broadcast_to(row_valid[:, None], (i.shape[0], q_ref.shape[1])),
                   other=0)
    q_pos = seq_len - (q_end - tok)
    last_tok = jnp.minimum(start + block_q, q_end) - 1
    kv_hi = jnp.where(start >= 0, seq_len - (q_end - last_tok) + 1, 0)
    kv_lo = jnp.where(start >= 0, _window_lo(seq_len - (q_end - start), kw["sliding_window"], kw["block_k"]), 0)
    acc, _, l = _kv_loop(q, q_pos, row_valid, r, kv_lo, kv_hi, k_ref, v_ref, bt_ref, ks_ref[h], h=h, **kw)
    out = acc * (vs_ref[h] / jnp.where(l > 0, l, 1.0))[:, None]
    plgpu.store(_rows(out_ref, q_rows), out.astype(out_ref.dtype),
                mask=jnp.broadcast_to(row_valid[:, None], out.shape))


def _decode_kernel(qsl_ref, seq_lens_ref, num_seqs_ref, bt_ref, ks_ref, vs_ref, q_ref, k_ref, v_ref,
                   *out_refs, group, rows, num_splits, **kw):
    r, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tok = qsl_ref[r]
    q_len = qsl_ref[r + 1] - tok
    seq_len = seq_lens_ref[r]
    active = (r < num_seqs_ref[0]) & (q_len == 1) & (seq_len > 0)
    num_q_heads = group * kw["kv_heads"]
    g = lax.iota(jnp.int32, rows)
    row_valid = active & (g < group)
    q_rows = tok * num_q_heads + h * group + g
    q = plgpu.load(_rows(q_ref, q_rows), mask=jnp.broadcast_to(row_valid[:, None], (rows, q_ref.shape[1])),
                   other=0)
    q_pos = jnp.broadcast_to(seq_len - 1, (rows,))
    block_k = kw["block_k"]
    lo = _window_lo(seq_len - 1, kw["sliding_window"], block_k)
    hi = jnp.where(active, seq_len, lo)
    chunk = pl.cdiv(pl.cdiv(hi - lo, num_splits), block_k) * block_k
    my_lo = lo + s * chunk
    my_hi = jnp.minimum(my_lo + chunk, hi)
    acc, m, l = _kv_loop(q, q_pos, row_valid, r, my_lo, jnp.maximum(my_hi, my_lo), k_ref, v_ref, bt_ref,
                         ks_ref[h], h=h, **kw)
    if num_splits == 1:                            # write the normalised rows straight into the output
        _out_in_ref, out_ref = out_refs
        out = acc * (vs_ref[h] / jnp.where(l > 0, l, 1.0))[:, None]
        plgpu.store(_rows(out_ref, q_rows), out.astype(out_ref.dtype),
                    mask=jnp.broadcast_to(row_valid[:, None], out.shape))
    else:                                          # partial state of this split, merged in XLA
        o_ref, m_ref, l_ref = out_refs
        part_rows = (s * seq_lens_ref.shape[0] + r) * num_q_heads + h * group + g
        store_mask = g < group
        plgpu.store(_rows(o_ref, part_rows), acc, mask=jnp.broadcast_to(store_mask[:, None], acc.shape))
        plgpu.store(m_ref.at[part_rows], m, mask=store_mask)
        plgpu.store(l_ref.at[part_rows], l, mask=store_mask)


def _prefill_schedule(md: AttentionMetadata, num_tokens: int, block_q: int):
    """Map each prefill program to (request, first token): requests with q_len > 1, cut in block_q tiles.

    The grid is static (``cdiv(T, block_q) + R`` bounds the tile count); programs past the real tiles
    get ``start = -1`` and do nothing.
    """
    num_reqs = md.seq_lens.shape[0]
    qsl = md.query_start_loc
    q_len = qsl[1:] - qsl[:-1]
    is_prefill = (jnp.arange(num_reqs) < md.num_seqs) & (q_len > 1)
    tiles = jnp.where(is_prefill, (q_len + block_q - 1) // block_q, 0)
    ends = jnp.cumsum(tiles)
    n_prog = -(-num_tokens // block_q) + num_reqs
    qb = jnp.arange(n_prog, dtype=jnp.int32)
    req = jnp.clip(jnp.searchsorted(ends, qb, side="right"), 0, num_reqs - 1).astype(jnp.int32)
    local = qb - (ends[req] - tiles[req])
    start = jnp.where(qb < ends[-1], qsl[req] + local * block_q, -1).astype(jnp.int32)
    return req, start, n_prog


def _pick_splits(num_reqs: int, kv_heads: int, max_ctx: int, block_k: int) -> int:
    """Flash-decoding splits: enough (request, head, split) programs for ~4 waves, >= 4 chunks a split."""
    want = max(1, (4 * NUM_SMS) // max(1, num_reqs * kv_heads))
    cap = max(1, max_ctx // (4 * block_k))
    return max(1, min(_next_pow2(want), _next_pow2(cap) if cap > 1 else 1))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "interpret", "decode_block_k", "decode_splits",
    "decode_warps", "decode_stages", "prefill_block_m", "prefill_block_k", "prefill_warps",
    "prefill_stages", "poison_output"))
def ragged_paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           k_scale=None, v_scale=None, interpret: bool = False,
                           decode_block_k: int = 64, decode_splits: int | None = None,
                           decode_warps: int = 4, decode_stages: int = 3,
                           prefill_block_m: int = 128, prefill_block_k: int = 64,
                           prefill_warps: int = 8, prefill_stages: int = 2, poison_output: bool = False):
    """Pallas version of ``ref_attention.ragged_paged_attention`` (same arguments, same result).

    ``k_scale``/``v_scale``: dequantisation scales (scalar or ``[kv_heads]``) of an fp8 cache, else None.
    The ``decode_*``/``prefill_*`` knobs are tile sizes and Triton launch parameters (static).
    ``poison_output`` (tests): start real tokens' rows as NaN so a row no kernel writes fails the check.
    """
    T, hq, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    R, P = md.block_tables.shape
    if hq % kvh:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({kvh})")
    group = hq // kvh
    group_pad = _next_pow2(group)
    ks, vs = head_scale(k_scale, kvh), head_scale(v_scale, kvh)
    q_flat = q.reshape(T * hq, d)
    k_flat = k_cache.reshape(nb * bs * kvh, d)
    v_flat = v_cache.reshape(nb * bs * kvh, d)
    bt = md.block_tables.reshape(R * P).astype(jnp.int32)
    qsl = md.query_start_loc.astype(jnp.int32)
    seq_lens = md.seq_lens.astype(jnp.int32)
    common = dict(kv_heads=kvh, block_size=bs, pages_per_seq=P, sm_scale=float(sm_scale),
                  soft_cap=soft_cap, sliding_window=sliding_window)
    out_shape = jax.ShapeDtypeStruct((T * hq, d), q.dtype)

    # Prefill launch: requests with q_len > 1, tiles of block_q tokens x group_pad heads.
    block_q = max(1, prefill_block_m // group_pad)
    req, start, n_prog = _prefill_schedule(md, T, block_q)
    out = jnp.zeros((T * hq, d), q.dtype)          # padding tokens stay zero
    if poison_output:
        real = jnp.repeat(jnp.arange(T) < qsl[md.num_seqs], hq)
        out = jnp.where(real[:, None], jnp.nan, out).astype(q.dtype)
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, group=group, group_pad=group_pad, block_q=block_q,
                          block_k=prefill_block_k, **common),
        grid=(n_prog, kvh),
        out_shape=out_shape,
        input_output_aliases={10: 0},
        compiler_params=plgpu.CompilerParams(num_warps=prefill_warps, num_stages=prefill_stages),
        interpret=interpret,
        name="ragged_paged_prefill",
    )(req, start, qsl, seq_lens, bt, ks, vs, q_flat, k_flat, v_flat, out)

    # Decode launch: requests with q_len == 1, one tile per (request, kv head, split).
    rows = max(16, group_pad)                      # tl.dot needs M >= 16
    splits = decode_splits or _pick_splits(R, kvh, P * bs, decode_block_k)
    kernel = functools.partial(_decode_kernel, group=group, rows=rows, num_splits=splits,
                               block_k=decode_block_k, **common)
    params = plgpu.CompilerParams(num_warps=decode_warps, num_stages=decode_stages)
    num_seqs = md.num_seqs.reshape(1).astype(jnp.int32)
    args = (qsl, seq_lens, num_seqs, bt, ks, vs, q_flat, k_flat, v_flat)
    if splits == 1:
        out = pl.pallas_call(kernel, grid=(R, kvh, 1), out_shape=out_shape, input_output_aliases={9: 0},
                             compiler_params=params, interpret=interpret, name="ragged_paged_decode")(*args, out)
        return out.reshape(T, hq, d)
    o_part, m_part, l_part = pl.pallas_call(
        kernel, grid=(R, kvh, splits),
        out_shape=(jax.ShapeDtypeStruct((splits * R * hq, d), jnp.float32),
                   jax.ShapeDtypeStruct((splits * R * hq,), jnp.float32),
                   jax.ShapeDtypeStruct((splits * R * hq,), jnp.float32)),
        compiler_params=params, interpret=interpret, name="ragged_paged_decode_split",
    )(*args)
    o_part = o_part.reshape(splits, R, hq, d)
    m_part, l_part = m_part.reshape(splits, R, hq), l_part.reshape(splits, R, hq)
    m_all = m_part.max(axis=0)
    w = jnp.exp2(m_part - m_all[None])
    l_all = (w * l_part).sum(axis=0)
    o = (w[..., None] * o_part).sum(axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    o = o * jnp.repeat(vs, group)[None, :, None]
    q_len = qsl[1:] - qsl[:-1]
    is_decode = (jnp.arange(R) < md.num_seqs) & (q_len == 1) & (seq_lens > 0)
    dst = jnp.where(is_decode, qsl[:-1], T)        # T is out of bounds: dropped
    out = out.reshape(T, hq, d).at[dst].set(o.astype(q.dtype), mode="drop")
    return out
