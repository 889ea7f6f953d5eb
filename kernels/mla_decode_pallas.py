"""Paged multi-head latent attention (DeepSeek's MLA, weight-absorbed) in Pallas (Triton lowering).

With the weights absorbed, MLA attention is MQA over one cached latent per token: the cache holds
``latent [num_blocks, block_size, R + P]`` (``c_kv = latent[..., :R]``, the compressed K/V; ``k_rope =
latent[..., R:]``, the decoupled rotary key), and every query head ``h`` of a token scores

    s[h, j] = sm_scale * (q_nope_latent[h] . c_kv[j] + q_rope[h] . k_rope[j])      (keys j <= its position)

and reads ``out[h] = softmax(s[h]) . c_kv`` (``[R]``: the caller projects it back through ``W_UV``). A key is
``R + P`` wide (576 for DeepSeek V2/V3), a value ``R`` (512), and all H heads share them.

One program serves a token's ``block_h`` heads (the MMA's M dimension) over one split of its context: each
``block_k``-key step loads the keys' latent rows once (``c_kv`` and ``k_rope`` as two row gathers of the cache
seen as ``[num_blocks * block_size, R + P]``) and uses the ``c_kv`` tile twice, as ``K`` in ``q_nope c_kv^T``
and as ``V`` in ``p c_kv``. So H heads read a page ``ceil(H / block_h)`` times, and the head groups of one
(token, split) are adjacent on the grid's fastest axis, so the second group's reads of a page meet it in L2.
Flash-decoding: when too few (token, head group) programs fill the chip, the KV axis is split and a combine
kernel merges the splits' softmax states (base-2, as ``flash_decoding``'s; its merge is per GQA head group
with a ``head_dim`` of 128, too wide a tile at ``R = 512``, hence one here that loops over the splits).

Steps with ``q_len > 1`` (prefill chunks) run tiles of ``block_t`` consecutive tokens of one request times
``block_h`` heads a program (``prefill_tiles``: 4 x 16 at 16 heads, one 64-row MMA), so a page load serves the
tile's tokens; each row masks the keys past its own token. Request r owns the tile slots from
``query_start_loc[r] // block_t + r`` (one for each ``block_t``-aligned tile its tokens touch); a program finds
its request by a binary search over that increasing start, and the step is padded to whole tiles.

An fp8 (e4m3) cache takes a per-tensor ``kv_scale``; its tiles are converted to f16 for the MMAs (Hopper
converts e4m3 to f16 in one instruction, to bf16 in none), and q is cast to f16 in the kernel after its load.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .device_info import SHARED_MEMORY, num_sms
from .metadata import SHORT_SEQ_LEN, AttentionMetadata
from .triton_rows import next_pow2, rows_of, store_rows

# Finite (as in paged_attention_pallas): an all-masked step gives exp2(0) = 1 garbage that the first real
# step wipes (its correction factor is exp2(MASK - m) = 0); a split with no keys keeps m = MASK, l = 0.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)
COMBINE_HEADS = 8          # heads per combine program: [8, R] f32 tiles, one split at a time
MIN_SPLIT_KEYS = 256       # below this a split's keys cost less than its partial state's round trip
SHORT_SPLIT_KEYS = 128     # a short step's splits (few programs): 4 of 128 keys beat 1 of 512 by 1.8x
SHORT_SPLIT_IDLE = 8       # a short step splits while its programs fill at most 1/8 of the SMs


def _cols(ref, rows, lo, n):
    """``[len(rows), n]`` view of columns ``lo : lo + n`` of rows ``rows`` of a 2-D ref."""
    return ref.at[rows[:, None], (lo + lax.iota(jnp.int32, n))[None, :]]


def _token_request(qsl_ref, num_reqs, t, decode_only, block_t=1):
    """Request owning token slot ``t`` (``block_t == 1``): ``t`` itself in a decode-only step, else a binary
    search for the last ``r`` with ``qsl[r] <= t`` (padding requests' empty ranges sit after the real ones).
    With ``block_t > 1`` ``t`` is a tile slot: request r owns slots ``qsl[r] // block_t + r`` onwards (one per
    ``block_t``-aligned tile its tokens touch), so the search is over that strictly increasing start."""
    if decode_only:
        return jnp.minimum(t, num_reqs - 1)
    lo, hi = jnp.int32(0), jnp.int32(num_reqs - 1)
    for _ in range(max(1, (num_reqs - 1).bit_length())):
        mid = (lo + hi + 1) // 2
        ok = (qsl_ref[mid] // block_t + mid if block_t > 1 else qsl_ref[mid]) <= t
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    return lo


def _mla_kernel(qsl_ref, seq_lens_ref, num_seqs_ref, bt_ref, scale_ref, qn_ref, qr_ref, cache_ref, *out_refs,
                num_heads, block_h, block_t, block_k, block_size, pages_per_seq, rank, rope, sm_scale, num_splits,
                dot_dtype, decode_only):
    hg, s, slot = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_reqs = seq_lens_ref.shape[0]
    num_tokens = qn_ref.shape[0] // num_heads
    r = _token_request(qsl_ref, num_reqs, slot, decode_only, block_t)
    q_start, q_end = qsl_ref[r], qsl_ref[r + 1]
    seq_len = seq_lens_ref[r]
    # the program's tokens: [t_lo, t_hi) of request r (one token, or the request's part of a block_t tile)
    t0 = (slot - r) * block_t if block_t > 1 else slot
    t_lo, t_hi = jnp.maximum(t0, q_start), jnp.minimum(t0 + block_t, q_end)
    active = (r < num_seqs_ref[0]) & (t_lo < t_hi) & (seq_len > 0)
    if decode_only:
        active &= q_end - q_start == 1
    hi = jnp.where(active, seq_len - (q_end - t_hi), 0)           # the last token sees keys [0, its position]
    full = jnp.where(active, seq_len - (q_end - t_lo) + 1, 0)     # keys every token of the program sees
    chunk = pl.cdiv(pl.cdiv(hi, num_splits), block_k) * block_k
    lo = jnp.minimum(s * chunk, hi)
    hi = jnp.minimum(lo + chunk, hi)

    # rows: block_t tokens x block_h heads, token-major
    g = lax.iota(jnp.int32, block_t * block_h)
    tok, head = t0 + g // block_h, hg * block_h + g % block_h
    row_valid = active & (head < num_heads) & (tok >= t_lo) & (tok < t_hi)
    pos = seq_len - (q_end - tok)                                 # each row's token sees keys [0, pos]
    # rows outside the program load a real row (in bounds) and store to distinct rows of their own (masked):
    # interpret mode's masked store rewrites the rows it skips, so two stores to one row would undo each other
    q_rows = tok * num_heads + head
    ld_rows = jnp.clip(tok, 0, num_tokens - 1) * num_heads + jnp.minimum(head, num_heads - 1)
    rows_n = block_t * block_h
    qn = plgpu.load(rows_of(qn_ref, ld_rows), mask=jnp.broadcast_to(row_valid[:, None], (rows_n, rank)), other=0)
    qr = plgpu.load(rows_of(qr_ref, ld_rows), mask=jnp.broadcast_to(row_valid[:, None], (rows_n, rope)), other=0)
    qn, qr = qn.astype(dot_dtype), qr.astype(dot_dtype)
    s_scale = sm_scale * scale_ref[0] * LOG2E
    offs = lax.iota(jnp.int32, block_k)

    def step(i, carry, masked):
        acc, m_prev, l_prev = carry
        key = lo + i * block_k + offs                                           # [BK]
        page = jnp.minimum(key // block_size, pages_per_seq - 1)
        rows = bt_ref[r * pages_per_seq + page] * block_size + key % block_size
        if masked:
            in_range = key < hi
            zero = jnp.zeros((), cache_ref.dtype)
            c = plgpu.load(_cols(cache_ref, rows, 0, rank), other=zero,
                           mask=jnp.broadcast_to(in_range[:, None], (block_k, rank)))
            kr = plgpu.load(_cols(cache_ref, rows, rank, rope), other=zero,
                            mask=jnp.broadcast_to(in_range[:, None], (block_k, rope)))
        else:
            c = plgpu.load(_cols(cache_ref, rows, 0, rank))
            kr = plgpu.load(_cols(cache_ref, rows, rank, rope))
        c, kr = c.astype(dot_dtype), kr.astype(dot_dtype)
        sc = (plgpu.dot(qn, c, trans_b=True, allow_tf32=False)
              + plgpu.dot(qr, kr, trans_b=True, allow_tf32=False)) * s_scale     # [rows, BK] f32, base 2
        if masked:
            see = in_range[None, :] & (key[None, :] <= pos[:, None]) if block_t > 1 else in_range[None, :]
            sc = jnp.where(see, sc, MASK_VALUE)
        m_new = jnp.maximum(m_prev, sc.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(sc - m_new[:, None])
        l_new = l_prev * alpha + p.sum(axis=-1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(dot_dtype), c, allow_tf32=False)
        return acc, m_new, l_new

    carry = (jnp.zeros((rows_n, rank), jnp.float32), jnp.full((rows_n,), MASK_VALUE, jnp.float32),
             jnp.zeros((rows_n,), jnp.float32))
    # whole steps every row sees need no mask; then the ragged end (and, for a tile, the causal diagonal)
    n_full = jnp.maximum(jnp.minimum(hi, full) - lo, 0) // block_k
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, pl.cdiv(jnp.maximum(hi - lo, 0), block_k),
                              functools.partial(step, masked=True), carry)
    if num_splits == 1:
        (out_ref,) = out_refs[-1:]
        out = acc * (scale_ref[0] / jnp.where(l > 0, l, 1.0))[:, None]
        store_rows(out_ref, q_rows, out, row_valid)
    else:
        o_ref, m_ref, l_ref = out_refs
        part = (s * num_tokens + slot) * num_heads + head
        keep = head < num_heads
        store_rows(o_ref, part, acc, keep)
        plgpu.store(m_ref.at[part], m, mask=keep)
        plgpu.store(l_ref.at[part], l, mask=keep)


def _combine_kernel(qsl_ref, num_seqs_ref, scale_ref, o_ref, m_ref, l_ref, *out_refs, num_heads, num_tokens,
                    num_splits, heads):
    """Token t's heads ``[hc * heads, (hc + 1) * heads)``: the splits' states merged one split at a time."""
    out_ref = out_refs[-1]
    t, hc = pl.program_id(0), pl.program_id(1)
    head = hc * heads + lax.iota(jnp.int32, heads)
    keep = head < num_heads
    base = t * num_heads + jnp.minimum(head, num_heads - 1)     # padding heads re-read a real head's state
    rank = o_ref.shape[1]

    def merge(s, carry):
        acc, m_run, l_run = carry
        part = s * num_tokens * num_heads + base
        m = plgpu.load(m_ref.at[part])
        m_new = jnp.maximum(m_run, m)
        a, w = jnp.exp2(m_run - m_new), jnp.exp2(m - m_new)
        o = plgpu.load(rows_of(o_ref, part))
        return acc * a[:, None] + o * w[:, None], m_new, l_run * a + plgpu.load(l_ref.at[part]) * w

    carry = (jnp.zeros((heads, rank), jnp.float32), jnp.full((heads,), MASK_VALUE, jnp.float32),
             jnp.zeros((heads,), jnp.float32))
    acc, _, l = lax.fori_loop(0, num_splits, merge, carry)
    real = t < qsl_ref[num_seqs_ref[0]]
    store_rows(out_ref, t * num_heads + head, acc * (scale_ref[0] / jnp.where(l > 0, l, 1.0))[:, None], real & keep)


def pick_splits(programs: int, max_ctx: int, block_k: int, programs_per_sm: int,
                short_keys: int | None = SHORT_SPLIT_KEYS) -> int:
    """KV splits (a power of two) so that ``programs`` (token, head group) programs times the splits fill
    the SMs' program slots about once, each split keeping at least ``MIN_SPLIT_KEYS`` keys and 2 steps. A
    step bounded by the runner's short-context bound (``metadata.SHORT_SEQ_LEN``) splits only where its
    programs leave most SMs idle (a batch of a few tokens), into splits of at least ``short_keys``: there one
    program walking its context is latency, and splits of it beat the combine's launch from a few hundred keys
    (this kernel: ``benchmarks/results/2026-12-06-h100-deepseek-gpu-checks.md``); a fuller chip, or
    ``short_keys=None``, runs one launch."""
    want = max(1, (programs_per_sm * num_sms()) // max(1, programs))
    want = 1 << (want.bit_length() - 1)                                  # round down: no half-empty last wave
    if max_ctx <= SHORT_SEQ_LEN:
        if short_keys is None or programs * SHORT_SPLIT_IDLE > num_sms():
            return 1
        cap = max(1, max_ctx // short_keys)
    else:
        cap = max(1, max_ctx // max(MIN_SPLIT_KEYS, 2 * block_k))
    return max(1, min(want, 1 << (cap.bit_length() - 1)))


def default_tiles(num_heads: int, fp8: bool) -> dict:
    """Launch defaults by head count: ``block_h`` heads per program (at most 64: a ``[64, 512]`` f32
    accumulator is 128 registers a thread at 8 warps), keys per step, warps, pipeline stages."""
    block_h = min(64, max(16, next_pow2(num_heads)))
    if block_h <= 16:     # memory-bound: a third stage in flight beats two programs sharing an SM
        return dict(block_h=block_h, block_k=32, num_warps=4, num_stages=3)
    if block_h == 64 and not fp8:   # the sweep's best (kernel_bench --only mla): longer key steps, two stages
        return dict(block_h=block_h, block_k=64, num_warps=8, num_stages=2)
    return dict(block_h=block_h, block_k=32, num_warps=4 if block_h <= 32 else 8, num_stages=4 if fp8 else 3)


def prefill_tiles(num_heads: int, fp8: bool) -> dict:
    """Launch defaults of a step with prefill chunks: ``block_t`` tokens of one request a program, so that the
    tile's ``block_t * block_h`` rows make one 64-row MMA and a key page loaded serves all its tokens."""
    block_h = min(64, max(16, next_pow2(num_heads)))
    return dict(block_h=block_h, block_t=64 // block_h, block_k=32, num_warps=8, num_stages=2 if not fp8 else 3)


def fit_shared(tiles: dict, width: int, q_itemsize: int, kv_itemsize: int) -> dict:
    """``tiles`` with fewer keys a step, then fewer stages, until what a program stages fits an SM's shared
    memory: its query tile (``block_t * block_h`` rows) and ``num_stages`` key tiles, ``width`` columns each
    (Triton stages ``num_stages - 1``; the one more is a margin for the kernel's other scratch: the float32
    prefill tile at 32 keys and 2 stages compiles for an H100 to 229,632 bytes of the 232,448, 8 KB past
    the ``num_stages - 1`` count). The 16-bit and fp8 defaults fit as they are."""
    t = dict(tiles)
    rows = t.get("block_t", 1) * t["block_h"]

    def need() -> int:
        return (rows * q_itemsize + t["num_stages"] * t["block_k"] * kv_itemsize) * width
    while need() > SHARED_MEMORY and t["block_k"] > 16:
        t["block_k"] //= 2
    while need() > SHARED_MEMORY and t["num_stages"] > 1:
        t["num_stages"] -= 1
    return t


def tileable(rank: int, rope: int) -> bool:
    """Whether the kernel tiles a latent rank and rope dim: powers of two of at least 16 (DeepSeek's 512, 64)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (rank, rope))


def latent_shapes(q_nope_latent, q_rope, latent_cache, kv_lora_rank: int | None) -> tuple[int, ...]:
    """``(T, H, R, P, num_blocks, block_size, R + P)`` of an MLA call, its arrays checked against each other."""
    T, H, R = q_nope_latent.shape
    P = q_rope.shape[-1]
    nb, bs, width = latent_cache.shape
    if kv_lora_rank is not None and kv_lora_rank != R:
        raise ValueError(f"q_nope_latent has {R} latent features, kv_lora_rank is {kv_lora_rank}")
    if q_rope.shape[:2] != (T, H) or width != R + P:
        raise ValueError(f"q_rope {q_rope.shape} and latent_cache {latent_cache.shape} do not match "
                         f"q_nope_latent {q_nope_latent.shape} (a cache row is R + P = {R} + {P})")
    return T, H, R, P, nb, bs, width


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "kv_lora_rank", "interpret", "block_h", "block_t", "block_k", "num_splits", "num_warps",
    "num_stages", "dot_dtype", "decode_only", "poison_output"))
def mla_paged_attention(q_nope_latent, q_rope, latent_cache, md: AttentionMetadata, *, sm_scale: float,
                        kv_lora_rank: int | None = None, kv_scale=None, interpret: bool = False,
                        block_h: int | None = None, block_t: int | None = None, block_k: int | None = None,
                        num_splits: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None, dot_dtype=None,
                        decode_only: bool | None = None, poison_output: bool = False):
    """Absorbed MLA attention over a paged latent cache: ``[T, H, R]`` (q's dtype).

    ``q_nope_latent [T, H, R]`` (the no-rope query already projected into the latent space), ``q_rope [T, H,
    P]`` (rotated), ``latent_cache [num_blocks, block_size, R + P]`` (``R = kv_lora_rank``; bf16, f32 or fp8
    e4m3 with the per-tensor ``kv_scale``, None = 1). Token t of request r (``md``'s ragged layout) attends
    causally to its request's cached tokens ``0 .. seq_lens[r] - (query_end - t) - 1``, its own included:
    the caller writes the step's latents first. R and P must be powers of two (at least 16).

    Tuning (static): ``block_h`` heads per program, ``block_t`` tokens of one request per program (a power of
    two; default 1 in a decode-only step, else ``prefill_tiles``: a chunk's tokens share each page load),
    ``block_k`` keys per step, ``num_splits`` (a power of two; 1 where ``block_t > 1``) flash-decoding splits
    of each token's context, ``num_warps``/``num_stages`` the Triton launch;
    ``dot_dtype`` the MMA operand dtype (default q's, f16 over an fp8 cache). ``decode_only`` (default
    ``md.decode_only``): every real request has one new token, so token slot t is request t (no search).
    The split count defaults from the contexts the step can see (``md.max_seq_len`` where set, else the block
    tables' span). Padding tokens' rows are left unwritten (every op after attention is row-wise, as for
    ``paged_attention_pallas``); ``poison_output`` (tests) passes in a buffer, real rows NaN, padding rows zero.
    """
    T, H, R, P, nb, bs, width = latent_shapes(q_nope_latent, q_rope, latent_cache, kv_lora_rank)
    if not tileable(R, P):
        raise ValueError(f"kv_lora_rank ({R}) and rope dim ({P}) must each be a power of two >= 16 (Triton tiles)")
    fp8 = jnp.dtype(latent_cache.dtype).itemsize == 1
    if decode_only is None:
        decode_only = md.decode_only
    prefill = not decode_only and (num_splits or 1) == 1 if block_t is None else block_t > 1
    if dot_dtype is None:
        dot_dtype = jnp.float16 if fp8 and q_nope_latent.dtype == jnp.bfloat16 else q_nope_latent.dtype
    tiles = fit_shared(prefill_tiles(H, fp8) if prefill else default_tiles(H, fp8), width,
                       jnp.dtype(dot_dtype).itemsize, jnp.dtype(latent_cache.dtype).itemsize)
    block_t = block_t or tiles.get("block_t", 1)
    block_h = block_h or tiles["block_h"]
    block_k = block_k or tiles["block_k"]
    num_warps = num_warps or tiles["num_warps"]
    num_stages = num_stages or tiles["num_stages"]
    if block_h < 16 or block_h & (block_h - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_h ({block_h}) and block_k ({block_k}) must be powers of two >= 16 (MMA tiles)")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    if block_t > 1 and (num_splits or 1) > 1:
        raise ValueError("num_splits > 1 needs block_t == 1 (a split holds one token's partial state)")
    Rq, pages = md.block_tables.shape
    groups = pl.cdiv(H, block_h)
    span = pages * bs if md.max_seq_len is None else min(pages * bs, md.max_seq_len)
    # a program of at most 16 heads leaves room for two per SM; wider ones take an SM's shared memory
    splits = num_splits or (1 if block_t > 1 else pick_splits(T * groups, span, block_k, 2 if block_h <= 16 else 1))
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    T_out = T
    if T % block_t:        # whole tiles: a tile's rows past the step's tokens stay in bounds (sliced off after)
        pad = ((0, -T % block_t), (0, 0), (0, 0))
        q_nope_latent, q_rope, T = jnp.pad(q_nope_latent, pad), jnp.pad(q_rope, pad), T + (-T % block_t)
    qsl = md.query_start_loc.astype(jnp.int32)
    scale = jnp.ones((1,), jnp.float32) if kv_scale is None else jnp.asarray(kv_scale, jnp.float32).reshape(1)
    ins = (qsl, md.seq_lens.astype(jnp.int32), md.num_seqs.reshape(1).astype(jnp.int32),
           md.block_tables.reshape(Rq * pages).astype(jnp.int32), scale, q_nope_latent.reshape(T * H, R),
           q_rope.reshape(T * H, P), latent_cache.reshape(nb * bs, width))
    out_shape = jax.ShapeDtypeStruct((T * H, R), q_nope_latent.dtype)
    outs, alias = (), {}
    if poison_output:
        real = jnp.repeat(jnp.arange(T) < qsl[md.num_seqs], H)[:, None]
        outs = (jnp.broadcast_to(jnp.where(real, jnp.nan, 0.0), (T * H, R)).astype(q_nope_latent.dtype),)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_mla_kernel, num_heads=H, block_h=block_h, block_t=block_t, block_k=block_k,
                               block_size=bs, pages_per_seq=pages, rank=R, rope=P, sm_scale=float(sm_scale),
                               num_splits=splits, dot_dtype=jnp.dtype(dot_dtype), decode_only=decode_only)
    if splits == 1:
        slots = T if block_t == 1 else T // block_t + Rq        # a request's tiles: slots qsl[r] // block_t + r..
        out = pl.pallas_call(kernel, grid=(groups, 1, slots), out_shape=out_shape,
                             input_output_aliases={len(ins): 0} if outs else {}, compiler_params=params,
                             interpret=interpret, name="mla_paged_decode" if block_t == 1 else "mla_paged_prefill")(
            *ins, *outs)
        return out.reshape(T, H, R)[:T_out]
    n = splits * T * H
    parts = pl.pallas_call(
        kernel, grid=(groups, splits, T), compiler_params=params, interpret=interpret, name="mla_paged_decode_split",
        out_shape=(jax.ShapeDtypeStruct((n, R), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32),
                   jax.ShapeDtypeStruct((n,), jnp.float32)))(*ins)
    heads = min(COMBINE_HEADS, next_pow2(H))
    if outs:
        alias = {6: 0}
    out = pl.pallas_call(
        functools.partial(_combine_kernel, num_heads=H, num_tokens=T, num_splits=splits, heads=heads),
        grid=(T, pl.cdiv(H, heads)), out_shape=out_shape, input_output_aliases=alias,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="mla_paged_combine")(qsl, ins[2], scale, *parts, *outs)
    return out.reshape(T, H, R)
