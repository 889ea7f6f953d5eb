"""Paged MLA decode (DeepSeek's absorbed MLA) for Hopper in Pallas Mosaic GPU: TMA page copies, wgmma.

The same computation as ``mla_decode_pallas`` (its docstring has the algebra): MQA over the latent cache
``[num_blocks, block_size, R + P]``, every query head scoring ``q_nope_latent . c_kv + q_rope . k_rope`` and
reading ``softmax . c_kv``. That kernel gathers rows by pointer loads; this one copies whole pages by TMA into a
ring of shared-memory slots and runs the matmuls as asynchronous wgmma.

Layout: keys are the MMAs' M, heads their N. With ``block_h`` heads a program (8, 16 or 32), the scores are
computed transposed, ``S^T [block_kv, block_h] = c_kv q_nope^T + k_rope q_rope^T`` (the page tiles as the A
operand, q from shared memory as B), and the output too, ``O^T [R, block_h] += c_kv^T P^T`` (the ``c_kv`` tile
read transposed as A, ``P`` stored to shared memory as B). Nothing is padded: wgmma's M is 64 per warpgroup,
and heads as M would pad 16 heads to 64 rows (4x the tensor-core work of a memory-bound kernel) and need a
``[64, R]`` float32 accumulator per warpgroup; here ``O^T`` is ``4 * block_h`` registers a thread. The softmax
runs over keys, i.e. over M, so its max and sum reduce across the warpgroup's four warps (Mosaic GPU's
cross-warp reduction through a shared-memory scratch).

Pipeline: one program per (token, KV split, head group), two warpgroups. The memory warpgroup streams the
program's K/V steps through ``stages`` slots: a step of ``block_kv`` keys is ``block_kv / block_size`` pages
(or a part of one page when pages are larger than a step), each page two TMA copies (its ``c_kv`` columns and
its rotary columns into two tiles, so each MMA operand is one tile), page ids read as scalars from the block
table, all landing on the slot's barrier; it refills a slot once the compute warpgroup has released it. The
compute warpgroup runs each step's two MMAs and the online softmax (base 2, the scale in exp2's argument).

Splits: when the (token, head group) programs do not fill the SMs (one program an SM: the ring takes most of
the shared memory), the context is split in a power of two (``mla_decode_pallas.pick_splits``; within the
runner's short-context bound not at all: there the splits' jnp combine is unmeasured); the programs then write
float32 states (``O^T`` per head group, m, l) and ``combine``, a few jnp ops XLA fuses, merges them. Unsplit
programs normalize and store the output themselves (padding tokens' rows get zeros).

Limits (``supported``; the caller falls back to ``mla_decode_pallas`` outside them): a 16-bit cache of q's
dtype (no fp8, no ``kv_scale``); heads a multiple of 8; R a multiple of 64 and P of 64; ``block_kv`` a multiple
of 64 (one wgmma M) and of the block size or dividing it; the block size a multiple of 8; the ring and tiles
within Hopper's 227 KiB of shared memory. Tokens with ``q_len > 1`` are served one program per token, as in
the Triton kernel (correct, not fast).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .metadata import AttentionMetadata
from .mla_decode_pallas import MASK_VALUE, _token_request, latent_shapes, pick_splits

LOG2E = math.log2(math.e)
SMEM_BYTES = 227 * 1024       # Hopper's shared memory per block
REDUCTION_SCRATCH = 128 * 4 * 4   # Mosaic GPU's default cross-warp reduction scratch (CompilerParams)
ALIGN_SLACK = 1024            # the buffers' alignment padding, which the lowering counts too
BLOCK_HS = (32, 16, 8)        # heads a program: the MMAs' N; O^T is 4 * block_h float32 registers a thread


def default_launch(num_tokens: int, num_heads: int, rank: int, rope: int, span: int, block_kv: int = 64,
                   stages: int = 2, itemsize: int = 2, num_splits: int | None = None) -> tuple[int, int]:
    """``(block_h, splits)``: the widest head group of ``BLOCK_HS`` dividing the head count whose tiles fit
    shared memory with ``num_splits`` or else the split count its program count asks for (a split's float32
    state tile is twice the output tile); ``(0, 1)`` if none does."""
    for bh in BLOCK_HS:
        if num_heads % bh:
            continue
        splits = num_splits or pick_splits(num_tokens * (num_heads // bh), span, block_kv, 1, short_keys=None)
        if smem_bytes(rank, rope, bh, block_kv, stages, splits > 1, itemsize) <= SMEM_BYTES:
            return bh, splits
    return 0, 1


def smem_bytes(rank: int, rope: int, block_h: int, block_kv: int, stages: int, split: bool, itemsize: int = 2) -> int:
    """Shared memory of one program: the K/V ring, q, P, the output tile (float32 for a split's state) and m, l."""
    ring = stages * block_kv * (rank + rope) * itemsize
    out = block_h * rank * (4 if split else itemsize)
    return ring + block_h * (rank + rope) * itemsize + block_h * block_kv * itemsize + out + 2 * block_h * 4 \
        + REDUCTION_SCRATCH + ALIGN_SLACK


def supported(q_nope_latent, q_rope, latent_cache, *, kv_scale=None,
              block_h: int | None = None, block_kv: int = 64, stages: int = 2, num_splits: int | None = None) -> bool:
    """Whether ``mla_paged_attention`` here handles this call (else use ``mla_decode_pallas``)."""
    T, H, R = q_nope_latent.shape
    P = q_rope.shape[-1]
    _, bs, width = latent_cache.shape
    dtype = jnp.dtype(q_nope_latent.dtype)
    pages_ok = (block_kv % bs == 0) if bs <= block_kv else (bs % block_kv == 0)
    split = num_splits is None or num_splits > 1
    fits = [bh for bh in ((block_h,) if block_h else BLOCK_HS) if bh in BLOCK_HS and H % bh == 0
            and smem_bytes(R, P, bh, block_kv, stages, split, dtype.itemsize) <= SMEM_BYTES]
    return (dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and latent_cache.dtype == dtype
            and q_rope.dtype == dtype and kv_scale is None and width == R + P and bool(fits)
            and R % 64 == 0 and P % 64 == 0 and block_kv % 64 == 0 and bs % 8 == 0 and pages_ok and stages >= 1)


def _kernel(meta_ref, qn_ref, qr_ref, cache_ref, *refs, num_reqs, pages_per_seq, block_h, block_kv, stages,
            sm_scale, num_splits, decode_only, interpret):
    out_refs, scoped = refs[:-1], refs[-1]
    (qn_s, qr_s, c_s, r_s, p_s, o_s, ml_s), (ready, free, q_bar) = scoped
    wg = lax.axis_index("wg")
    g, s, t = lax.axis_index("group"), lax.axis_index("split"), lax.axis_index("tok")
    _, bs, _ = cache_ref.shape
    R, P = qn_ref.shape[-1], qr_ref.shape[-1]

    # meta = [query_start_loc (num_reqs + 1), seq_lens (num_reqs), num_seqs (1), block_tables (num_reqs x pages)]
    qsl_ref = meta_ref.at[pl.ds(0, num_reqs + 1)]
    seq_lens_ref = meta_ref.at[pl.ds(num_reqs + 1, num_reqs)]
    num_seqs = meta_ref[2 * num_reqs + 1]
    bt_ref = meta_ref.at[pl.ds(2 * num_reqs + 2, num_reqs * pages_per_seq)]

    r = _token_request(qsl_ref, num_reqs, t, decode_only)
    q_start, q_end = qsl_ref[r], qsl_ref[r + 1]
    seq_len = seq_lens_ref[r]
    active = (r < num_seqs) & (q_start <= t) & (t < q_end) & (seq_len > 0)
    if decode_only:
        active &= q_end - q_start == 1
    hi = jnp.where(active, seq_len - (q_end - t) + 1, 0)          # the token sees keys [0, its position]
    chunk = pl.cdiv(pl.cdiv(hi, num_splits), block_kv) * block_kv
    lo = jnp.minimum(s * chunk, hi)
    hi = jnp.minimum(lo + chunk, hi)
    n_steps = pl.cdiv(hi - lo, block_kv)                          # lo is a multiple of block_kv

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        @pl.when(n_steps > 0)
        def _():
            heads = pl.ds(g * block_h, block_h)
            plgpu.copy_gmem_to_smem(qn_ref.at[t, heads], qn_s, q_bar)
            plgpu.copy_gmem_to_smem(qr_ref.at[t, heads], qr_s, q_bar)
            plgpu.barrier_wait(q_bar)

        c = sm_scale * LOG2E
        m = plgpu.layout_cast(jnp.full((block_h,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
        l = plgpu.layout_cast(jnp.zeros((block_h,), jnp.float32), plgpu.Layout.WGMMA.reduce(0))
        acc = plgpu.layout_cast(jnp.zeros((R, block_h), jnp.float32), plgpu.Layout.WGMMA)

        def step(i, carry, masked):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(ready.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, c_s.at[slot], qn_s.T)
                plgpu.wgmma(acc_ref, r_s.at[slot], qr_s.T)
                return acc_ref[...]
            sc = pl.run_scoped(scores, plgpu.ACC((block_kv, block_h), jnp.float32)) * c   # [keys, heads], base 2
            if masked:
                key = lo + i * block_kv + plgpu.broadcasted_iota(jnp.int32, sc.shape, 0, layout=plgpu.Layout.WGMMA)
                sc = jnp.where(key < hi, sc, MASK_VALUE)
            m_new = jnp.maximum(m, sc.max(axis=0))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [1]))
            l = l * alpha + p.sum(axis=0)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
            p_s.T[...] = p.astype(p_s.dtype)            # P^T registers into P's [heads, keys] tile
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, c_s.at[slot].T, p_s.T)
            if interpret:          # interpret mode has no run_state: a fresh accumulator, then add
                def pv_fresh(acc_ref):
                    pv(acc_ref)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((R, block_h), jnp.float32))
            else:                  # the MMA adds into acc
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(free.at[slot])
            return acc, m_new, l

        n_full = (hi - lo) // block_kv                  # whole steps need no mask; the ragged end one step
        carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(n_full, n_steps, functools.partial(step, masked=True), carry)

        heads = pl.ds(g * block_h, block_h)
        if num_splits == 1:
            (out_ref,) = out_refs
            acc = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [1])
            o_s.T[...] = acc.astype(o_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, out_ref.at[t, heads])
        else:
            o_ref, m_ref, l_ref = out_refs
            o_s[...] = acc                              # O^T as it is: the combine reads it transposed
            ml_s.at[0][...] = m
            ml_s.at[1][...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[s, t, g])
            plgpu.copy_smem_to_gmem(ml_s.at[0], m_ref.at[s, t, heads])
            plgpu.copy_smem_to_gmem(ml_s.at[1], l_ref.at[s, t, heads])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        base = r * pages_per_seq

        @pl.loop(0, n_steps)
        def _stream(i):
            slot = lax.rem(i, stages)
            key0 = lo + i * block_kv
            # the page ids first: their loads from the block table complete while the slot is still in use
            if bs <= block_kv:
                copies = [(bt_ref[base + jnp.minimum(key0 // bs + j, pages_per_seq - 1)], pl.ds(0, bs),
                           pl.ds(j * bs, bs)) for j in range(block_kv // bs)]
            else:
                copies = [(bt_ref[base + key0 // bs], pl.ds(lax.rem(key0, bs), block_kv), pl.ds(0, block_kv))]
            pl.when(i >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))     # step i - stages released it
            for page, rows, dst in copies:
                plgpu.copy_gmem_to_smem(cache_ref.at[page, rows, pl.ds(0, R)], c_s.at[slot, dst], ready.at[slot])
                plgpu.copy_gmem_to_smem(cache_ref.at[page, rows, pl.ds(R, P)], r_s.at[slot, dst], ready.at[slot])

        @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
        def _last(i):                                   # the last steps' release: every barrier phase observed
            plgpu.barrier_wait(free.at[lax.rem(i, stages)])


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "kv_lora_rank", "interpret", "block_h", "block_kv", "stages", "num_splits", "decode_only",
    "poison_output"))
def mla_paged_attention(q_nope_latent, q_rope, latent_cache, md: AttentionMetadata, *, sm_scale: float,
                        kv_lora_rank: int | None = None, kv_scale=None,
                        interpret: bool | plgpu.InterpretGPUParams = False, block_h: int | None = None,
                        block_kv: int = 64, stages: int = 2, num_splits: int | None = None,
                        decode_only: bool | None = None, poison_output: bool = False):
    """Absorbed MLA attention over a paged latent cache: ``[T, H, R]`` (q's dtype); ``mla_decode_pallas``'s
    contract (arguments, causality, padding) for the calls ``supported`` accepts.

    Tuning (static): ``block_h`` heads a program (default: ``default_launch``'s), ``block_kv``
    keys a step, ``stages`` ring slots, ``num_splits`` (a power of two; default from the contexts the step can
    see). ``interpret``: Mosaic GPU's interpret mode on CPU, or a ``plgpu.InterpretGPUParams``.
    Every row is written (padding tokens' rows zero): ``poison_output`` is accepted for the Triton kernel's
    signature and changes nothing.
    """
    T, H, R, P, nb, bs, width = latent_shapes(q_nope_latent, q_rope, latent_cache, kv_lora_rank)
    if decode_only is None:
        decode_only = md.decode_only
    Rq, pages = md.block_tables.shape
    span = pages * bs if md.max_seq_len is None else min(pages * bs, md.max_seq_len)
    if block_h is None:
        block_h, splits = default_launch(T, H, R, P, span, block_kv, stages, q_nope_latent.dtype.itemsize, num_splits)
        block_h = block_h or BLOCK_HS[-1]
    else:
        splits = num_splits or pick_splits(T * (H // block_h), span, block_kv, 1, short_keys=None)
    groups = H // block_h
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    if not supported(q_nope_latent, q_rope, latent_cache, kv_scale=kv_scale, block_h=block_h, block_kv=block_kv,
                     stages=stages, num_splits=splits):
        raise ValueError(f"the Mosaic GPU MLA kernel does not take q {q_nope_latent.shape} {q_nope_latent.dtype}, "
                         f"cache {latent_cache.shape} {latent_cache.dtype}, kv_scale {kv_scale}, block_h {block_h}, "
                         f"block_kv {block_kv}, stages {stages}: use mla_decode_pallas")
    qsl = md.query_start_loc.astype(jnp.int32)
    num_seqs = md.num_seqs.reshape(1).astype(jnp.int32)
    # One fresh metadata buffer: Mosaic GPU kernels take only 256-byte-aligned inputs, and the engine's step
    # arrays are slices of one packed host transfer.
    meta = jnp.concatenate([qsl, md.seq_lens.astype(jnp.int32), num_seqs,
                            md.block_tables.reshape(Rq * pages).astype(jnp.int32)])
    dtype = q_nope_latent.dtype
    mma_tile = dict(transforms=(plgpu.TilingTransform((8, 128 // dtype.itemsize)), plgpu.SwizzleTransform(128)))
    if splits == 1:
        out_type = jax.ShapeDtypeStruct((T, H, R), dtype)
        o_tile = plgpu.SMEM((block_h, R), dtype, **mma_tile)
    else:
        out_type = (jax.ShapeDtypeStruct((splits, T, groups, R, block_h), jnp.float32),
                    jax.ShapeDtypeStruct((splits, T, H), jnp.float32),
                    jax.ShapeDtypeStruct((splits, T, H), jnp.float32))
        o_tile = plgpu.SMEM((R, block_h), jnp.float32)
    copies = 2 * max(1, block_kv // bs)                 # TMA copies landing on a slot's barrier
    kernel = functools.partial(_kernel, num_reqs=Rq, pages_per_seq=pages, block_h=block_h, block_kv=block_kv,
                               stages=stages, sm_scale=float(sm_scale), num_splits=splits, decode_only=decode_only,
                               interpret=bool(interpret))

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            (plgpu.SMEM((block_h, R), dtype, **mma_tile), plgpu.SMEM((block_h, P), dtype, **mma_tile),
             plgpu.SMEM((stages, block_kv, R), dtype, **mma_tile), plgpu.SMEM((stages, block_kv, P), dtype, **mma_tile),
             plgpu.SMEM((block_h, block_kv), dtype, **mma_tile), o_tile, plgpu.SMEM((2, block_h), jnp.float32)),
            (plgpu.Barrier(num_arrivals=copies, num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=2)),
            collective_axes="wg",
        )

    if isinstance(interpret, plgpu.InterpretGPUParams):
        params = interpret
    else:
        params = plgpu.InterpretGPUParams() if interpret else None
    out = plgpu.kernel(
        entry, out_type=out_type, grid=(groups, splits, T), grid_names=("group", "split", "tok"), num_threads=2,
        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True), interpret=params,
    )(meta, q_nope_latent, q_rope, latent_cache)
    if splits == 1:
        return out
    return combine(*out, dtype)


def combine(o, m, l, dtype):
    """The splits' states merged (XLA fuses it): ``o [splits, T, groups, R, block_h]`` (unnormalized O^T per
    head group), ``m``, ``l [splits, T, H]`` (base-2 running max and sum) -> ``[T, H, R]``. Tokens without
    keys (padding) have ``l = 0`` in every split and get zeros."""
    splits, T, groups, R, block_h = o.shape
    o = o.transpose(0, 1, 2, 4, 3).reshape(splits, T, groups * block_h, R)
    w = jnp.exp2(m - m.max(axis=0))
    total = (w * l).sum(axis=0)
    out = (w[..., None] * o).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)
