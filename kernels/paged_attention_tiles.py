"""The tiles of the ragged paged attention kernel (``paged_attention_pallas``, which launches them and documents
the design): the online-softmax loop over a request's K/V pages (``_kv_loop``), the prefill tile (``block_q``
tokens x a GQA group, its request found in-kernel), the decode tile (one request x kv head x flash-decoding
split, optionally writing the step's own K/V: ``_own_key``), and the two kernel bodies that run them
(``decode_kernel``: decode tiles alone; ``fused_kernel``: prefill tiles, then decode tiles, in one launch).
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .metadata import PAD_SLOT
from .ref_attention import FP8_DTYPE, FP8_MAX
from .triton_rows import rows_of, store_rows

# Finite, so a fully masked chunk gives exp2(MASK - MASK) = 1 instead of NaN; such a row's garbage is
# wiped by the first real chunk (its correction factor is exp2(MASK - m_real) = 0) and rows that never
# see a real key are padding rows, which are never stored.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)


def _kv_loop(q, q_pos, first_q_pos, last_q_pos, r, kv_lo, kv_hi, k_ref, v_ref, bt_ref, k_scale, *, h,
             kv_heads, block_size, pages_per_seq, block_k, sm_scale, soft_cap, sliding_window, v_transposed,
             q_lim=None):
    """Online softmax of tile ``q [M, D]`` over the request's keys ``[kv_lo, kv_hi)`` in steps of block_k.

    ``q_pos [M]`` are the rows' absolute positions, ``first_q_pos``/``last_q_pos`` those of the tile's
    first and last real token; ``q_lim [M]`` (``md.attend_limit``): each row's last visible key where it is
    past ``q_pos`` (the window still counts from ``q_pos``). Chunks that no mask can touch for any row (below
    the first row's diagonal, inside the last row's window, below kv_hi) run without masks; the rest (window edge, diagonal, ragged
    end) with them. Returns the unnormalised accumulator ``[M, D]`` f32 and running max / sum ``[M]``
    (base 2). The caches are ``[num_blocks, kv_heads, block_size, D]`` (a page's rows of one head are
    contiguous). ``v_transposed`` (fp8 caches): V pages are
    ``[num_blocks, kv_heads, D, block_size]`` (keys contiguous), gathered as a ``[D, pages, block_size]`` tile
    whose last axis Triton can see is contiguous, reshaped to ``[D, block_k]``; P.V then takes V^T as the
    matmul's K-major operand, as QK^T takes K. Needs ``kv_lo`` and ``block_k`` multiples of ``block_size``.
    """
    m_rows, d = q.shape
    offs = lax.iota(jnp.int32, block_k)
    s_scale = sm_scale * k_scale

    def body(i, carry, masked):
        acc, m_prev, l_prev = carry
        pos = kv_lo + i * block_k + offs                                      # [BK]
        page = jnp.minimum(pos // block_size, pages_per_seq - 1)
        blk = bt_ref[r * pages_per_seq + page]                                # [BK]
        rows = (blk * kv_heads + h) * block_size + pos % block_size
        if masked:
            in_range = pos < kv_hi
            ld_mask = jnp.broadcast_to(in_range[:, None], (block_k, d))
            zero = jnp.zeros((), k_ref.dtype)
            k = plgpu.load(rows_of(k_ref, rows), mask=ld_mask, other=zero)      # [BK, D]
            if not v_transposed:
                v = plgpu.load(rows_of(v_ref, rows), mask=ld_mask, other=zero)
        else:
            k = plgpu.load(rows_of(k_ref, rows))
            if not v_transposed:
                v = plgpu.load(rows_of(v_ref, rows))
        if v_transposed:                                                      # v: V^T [D, BK]
            n_pg = block_k // block_size
            pos_pg = kv_lo + i * block_k + lax.iota(jnp.int32, n_pg) * block_size         # [PT] page starts
            blk_pg = bt_ref[r * pages_per_seq + jnp.minimum(pos_pg // block_size, pages_per_seq - 1)]
            vt_rows = (blk_pg[None, :] * kv_heads + h) * d + lax.iota(jnp.int32, d)[:, None]    # [D, PT]
            cols = lax.iota(jnp.int32, block_size)
            vt_ref = v_ref.at[vt_rows[:, :, None], cols[None, None, :]]                     # [D, PT, bs]
            if masked:
                vt_mask = jnp.broadcast_to(((pos_pg[:, None] + cols[None, :]) < kv_hi)[None], (d, n_pg, block_size))
                v = plgpu.load(vt_ref, mask=vt_mask, other=jnp.zeros((), v_ref.dtype))
            else:
                v = plgpu.load(vt_ref)
            v = v.reshape(d, block_k)
        if k.dtype != q.dtype:                                                # fp8 cache
            k = k.astype(q.dtype)
            v = v.astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * s_scale    # [M, BK] f32
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = s * LOG2E
        if masked:
            mask = (pos[None, :] <= (q_pos if q_lim is None else q_lim)[:, None]) & in_range[None, :]
            if sliding_window is not None:
                mask &= pos[None, :] > q_pos[:, None] - sliding_window
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_prev * alpha + p.sum(axis=-1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, trans_b=v_transposed, allow_tf32=False)
        return acc, m_new, l_new

    n_iter = jnp.maximum(pl.cdiv(kv_hi - kv_lo, block_k), 0)
    # [c_full_lo, c_full_hi): chunks fully visible to every row of the tile.
    c_full_lo = jnp.int32(0)
    if sliding_window is not None:
        c_full_lo = jnp.clip(pl.cdiv(jnp.maximum(last_q_pos - sliding_window + 1 - kv_lo, 0), block_k), 0, n_iter)
    c_full_hi = jnp.clip(jnp.maximum(jnp.minimum(first_q_pos + 1, kv_hi) - kv_lo, 0) // block_k, c_full_lo, n_iter)
    carry = (jnp.zeros((m_rows, d), jnp.float32), jnp.full((m_rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((m_rows,), jnp.float32))
    masked = functools.partial(body, masked=True)
    if sliding_window is not None:
        carry = lax.fori_loop(0, c_full_lo, masked, carry)
    carry = lax.fori_loop(c_full_lo, c_full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(c_full_hi, n_iter, masked, carry)


def _window_lo(first_q_pos, sliding_window, block_k):
    if sliding_window is None:
        return jnp.int32(0)
    lo = jnp.maximum(first_q_pos - sliding_window + 1, 0)
    return (lo // block_k) * block_k


class _Refs:
    """The kernel's inputs by name (Pallas passes refs positionally); ``slots`` (the slot mapping) only when
    the decode launch writes the step's K/V."""
    NAMES = ("qsl", "seq_lens", "num_seqs", "bt", "ks", "vs", "q", "k", "v", "slots")

    def __init__(self, refs, limit=None):
        for name, ref in zip(self.NAMES, refs):
            setattr(self, name, ref)
        self.limit = limit           # md.attend_limit [T] (prefill tiles), or None


def _prefill_tile(x: _Refs, out_ref, qb, h, *, group, group_pad, block_q, q_stride, dot_dtype, **kw):
    """Tile ``qb`` of the prefill schedule for kv head h: ``block_q`` tokens x the group's q heads.

    Schedule (vLLM's trick, no host/XLA pre-pass): request r owns tile slots
    ``[qsl[r] // block_q + r, qsl[r+1] // block_q + r + 1)``, at least ``cdiv(q_len, block_q)`` of them;
    a binary search over that monotone start finds the request. Slots past a request's tokens, decode
    requests (q_len 1, handled by the decode tiles) and padding requests do nothing. A step without prefill
    tokens (``qsl[num_seqs] == num_seqs``) skips the search: the idle slots' chains of dependent scalar
    loads made short decode calls slow.
    """
    n = x.num_seqs[0]

    @pl.when(x.qsl[n] > n)
    def _():
        _prefill_tile_body(x, out_ref, qb, h, group=group, group_pad=group_pad, block_q=block_q, q_stride=q_stride,
                           dot_dtype=dot_dtype, **kw)


def _prefill_tile_body(x: _Refs, out_ref, qb, h, *, group, group_pad, block_q, q_stride, dot_dtype, **kw):
    num_reqs = x.seq_lens.shape[0]
    lo, hi = jnp.int32(0), jnp.int32(num_reqs - 1)
    for _ in range(max(1, (num_reqs - 1).bit_length())):
        mid = (lo + hi + 1) // 2
        ok = x.qsl[mid] // block_q + mid <= qb
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    r = lo
    q_start, q_end = x.qsl[r], x.qsl[r + 1]
    start = q_start + (qb - (q_start // block_q + r)) * block_q
    active = (r < x.num_seqs[0]) & (q_end - q_start > 1) & (start < q_end)
    seq_len = x.seq_lens[r]
    num_q_heads = group * kw["kv_heads"]
    i = lax.iota(jnp.int32, block_q * group_pad)
    tok = start + i // group_pad
    g = i % group_pad
    row_valid = active & (tok < q_end) & (g < group)
    q_rows = tok * num_q_heads + h * group + g
    q = plgpu.load(rows_of(x.q, tok * q_stride + h * group + g),
                   mask=jnp.broadcast_to(row_valid[:, None], (i.shape[0], x.q.shape[1])), other=0)
    if dot_dtype is not None:
        q = q.astype(dot_dtype)
    q_pos = seq_len - (q_end - tok)
    first_q_pos = seq_len - (q_end - start)
    last_q_pos = seq_len - (q_end - jnp.minimum(start + block_q, q_end)) - 1
    q_lim, last_key = None, last_q_pos
    if x.limit is not None:      # rows inside an image span see up to its end: the tile reads that far
        q_lim = jnp.maximum(q_pos, x.limit[jnp.minimum(tok, x.limit.shape[0] - 1)])
        last_key = jnp.maximum(last_q_pos, jnp.max(jnp.where(row_valid, q_lim, 0)))
    kv_hi = jnp.where(active, last_key + 1, 0)
    kv_lo = jnp.where(active, _window_lo(first_q_pos, kw["sliding_window"], kw["block_k"]), 0)
    acc, _, l = _kv_loop(q, q_pos, first_q_pos, last_q_pos, r, kv_lo, kv_hi, x.k, x.v, x.bt, x.ks[h], h=h,
                         q_lim=q_lim, **kw)
    out = acc * (x.vs[h] / jnp.where(l > 0, l, 1.0))[:, None]
    store_rows(out_ref, q_rows, out, row_valid)


def _decode_tile(x: _Refs, out_refs, r, s, h, *, group, rows, num_splits, q_stride, dot_dtype, new_kv=None,
                 **kw):
    """Request r's decode token (if q_len == 1) for kv head h over split s of its context.

    ``new_kv`` (the decode launch that also writes the step's K/V): ``(kc_ref, vc_ref, num_q_heads)``; the
    token's own K and V are rows ``num_q_heads + h`` and ``num_q_heads + kv_heads + h`` of its packed q row.
    The split whose range holds the token's position stores them at ``slots[tok]`` (quantized for fp8) and
    takes that key from registers instead of the cache (``_own_key``): no program reads a slot this launch
    writes, so there is no ordering between programs to get wrong. A token whose slot is ``PAD_SLOT`` (a
    multi-step loop's finished row) writes nothing and attends to the cache as it is."""
    tok = x.qsl[r]
    seq_len = x.seq_lens[r]
    active = (r < x.num_seqs[0]) & (x.qsl[r + 1] - tok == 1) & (seq_len > 0)
    num_q_heads = group * kw["kv_heads"]
    g = lax.iota(jnp.int32, rows)
    row_valid = active & (g < group)
    q_rows = tok * num_q_heads + h * group + g
    q = plgpu.load(rows_of(x.q, tok * q_stride + h * group + g),
                   mask=jnp.broadcast_to(row_valid[:, None], (rows, x.q.shape[1])), other=0)
    if dot_dtype is not None:
        q = q.astype(dot_dtype)
    q_pos = jnp.broadcast_to(seq_len - 1, (rows,))
    block_k = kw["block_k"]
    lo = _window_lo(seq_len - 1, kw["sliding_window"], block_k)
    hi = jnp.where(active, seq_len, lo)
    chunk = pl.cdiv(pl.cdiv(hi - lo, num_splits), block_k) * block_k
    my_lo = lo + s * chunk
    my_hi = jnp.maximum(jnp.minimum(my_lo + chunk, hi), my_lo)
    cache_hi = my_hi
    if new_kv is not None:
        new_pos = seq_len - 1
        slot = x.slots[jnp.minimum(tok, x.slots.shape[0] - 1)]     # a padding request's tok may be T
        own = active & (slot != PAD_SLOT) & (my_lo <= new_pos) & (new_pos < my_hi)
        cache_hi = jnp.where(own, new_pos, my_hi)
    acc, m, l = _kv_loop(q, q_pos, seq_len - 1, seq_len - 1, r, my_lo, cache_hi, x.k, x.v, x.bt, x.ks[h], h=h, **kw)
    if new_kv is not None:
        acc, m, l = _own_key(x, new_kv, q, acc, m, l, tok, slot, h, own, q_stride=q_stride, **kw)
    if num_splits == 1:                            # normalised rows straight into the output
        (out_ref,) = out_refs
        store_rows(out_ref, q_rows, acc * (x.vs[h] / jnp.where(l > 0, l, 1.0))[:, None], row_valid)
    else:                                          # this split's softmax state, merged by flash_decoding.combine
        o_ref, m_ref, l_ref = out_refs
        part_rows = (s * x.seq_lens.shape[0] + r) * num_q_heads + h * group + g
        keep = g < group
        store_rows(o_ref, part_rows, acc, keep)
        plgpu.store(m_ref.at[part_rows], m, mask=keep)
        plgpu.store(l_ref.at[part_rows], l, mask=keep)


def _own_key(x: _Refs, new_kv, q, acc, m, l, tok, slot, h, own, *, q_stride, kv_heads, block_size, sm_scale, soft_cap,
             v_transposed, **_):
    """Token ``tok``'s own K/V for kv head h: stored into the caches at its slot and, where ``own``, one more
    key of the online softmax ``(acc, m, l)``, taken as the cache would give it back (the cache dtype's
    rounding, or fp8's quantization), so the result is what reading the just-written cache gives."""
    kc_ref, vc_ref, hq = new_kv
    d = q.shape[1]
    one = lax.iota(jnp.int32, 1)
    src = jnp.where(own, tok * q_stride + hq + h, 0) + one                     # [1]; in bounds when not own
    cached = []
    for off, scale_ref, dst in ((0, x.ks, kc_ref), (kv_heads, x.vs, vc_ref)):
        val = plgpu.load(rows_of(x.q, src + off))                                 # [1, D]
        if dst.dtype == FP8_DTYPE:
            val = jnp.clip(val.astype(jnp.float32) / scale_ref[h], -FP8_MAX, FP8_MAX)
        cached.append(val.astype(dst.dtype))

    @pl.when(own)
    def _():
        page_row = ((slot // block_size) * kv_heads + h) * block_size + slot % block_size
        plgpu.store(rows_of(kc_ref, page_row + one), cached[0])
        if v_transposed:                       # V^T pages: the token's values go down column slot % block_size
            feat = ((slot // block_size) * kv_heads + h) * d + lax.iota(jnp.int32, d)
            col = jnp.broadcast_to(slot % block_size, (1, d))
            plgpu.store(vc_ref.at[feat[None, :], col], cached[1])
        else:
            plgpu.store(rows_of(vc_ref, page_row + one), cached[1])

    k_new, v_new = (c.astype(q.dtype).astype(jnp.float32) for c in cached)    # as _kv_loop reads the cache
    s = jnp.sum(q.astype(jnp.float32) * k_new, axis=1) * (sm_scale * x.ks[h])  # [M]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(own, s * LOG2E, MASK_VALUE)
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(own, jnp.exp2(s - m_new), 0.0)
    return acc * alpha[:, None] + p[:, None] * v_new, m_new, l * alpha + p


def decode_kernel(*refs, tile_kw, n_in, write_kv):
    """``n_in``: the inputs (9, or 10 with the slot mapping when ``write_kv``; one more when the output
    buffer comes in, aliased and skipped here). ``write_kv``: the last two outputs are the K and V caches."""
    x = _Refs(refs[:10 if write_kv else 9])
    outs = refs[n_in:]
    new_kv = None
    if write_kv:
        outs, new_kv = outs[:-2], (outs[-2], outs[-1], tile_kw["group"] * tile_kw["kv_heads"])
    _decode_tile(x, outs, pl.program_id(0), pl.program_id(2), pl.program_id(1), new_kv=new_kv, **tile_kw)


def fused_kernel(*refs, n_prefill, prefill_kw, decode_kw, n_in, limited):
    """Prefill tiles first (the long ones start early), then (request, split) decode tiles.
    ``n_in``: 9 inputs (10 with ``md.attend_limit``: ``limited``), one more when the output buffer also comes
    in (aliased; poisoned for tests)."""
    x = _Refs(refs[:9], refs[9] if limited else None)
    out_ref = refs[n_in]
    pid, h = pl.program_id(0), pl.program_id(1)
    splits = decode_kw["num_splits"]
    decode_outs = (out_ref,) if splits == 1 else refs[n_in + 1:]

    @pl.when(pid < n_prefill)
    def _():
        _prefill_tile(x, out_ref, pid, h, **prefill_kw)

    @pl.when(pid >= n_prefill)
    def _():
        idx = pid - n_prefill
        _decode_tile(x, decode_outs, idx // splits, idx % splits, h, **decode_kw)
