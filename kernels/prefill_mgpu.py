"""Paged causal prefill attention for Hopper in Pallas Mosaic GPU (TMA, wgmma, warp specialisation).

Computes the output rows of the step's **prefill tokens** (requests with ``q_len > 1``) of
``ragged_paged_attention``; decode tokens and padding are left to the caller (``paged_attention_pallas``
runs its Triton decode launch into the same buffer). Every prefill token attends causally to its request's
whole context through the block table, cached prefix included, so chunked prefill and prefix-cache hits
take the same path as a fresh prompt.

Why a second backend for prefill: prefill is compute-bound, and the Triton lowering topped out at
243-247 TFLOP/s on 8 x 2048 causal (a sweep of 12 launch configurations, H200, 2026-11-30), where the
stock dense Mosaic GPU flash attention reached 472. Mosaic GPU gives Hopper's asynchronous tensor-core
MMA (wgmma) and the TMA copy engine, so one warpgroup can stream K/V while two others compute.

Layout of one program (``grid = (q heads, tile slots)``, three warpgroups of 128 threads):
* two **compute warpgroups**, each owning 64 query rows (one wgmma M) of the tile's 128 tokens for one q
  head; they alternate their tensor-core phases through a shared barrier (one does QK^T while the other
  does its softmax), the FA3 ping-pong;
* one **memory warpgroup** streaming the K/V of the tile's kv head through ``stages`` shared-memory slots.
  A K/V step of ``block_kv`` keys is ``block_kv / block_size`` pages, one TMA copy per page (the page ids
  read from the block table as scalars), all landing on the slot's barrier.

Tile schedule (no XLA pre-pass): request r owns slots ``[qsl[r] // 128 + r, qsl[r+1] // 128 + r + 1)``;
a program finds its request by binary search over that monotone start. Slots past a request's tokens,
decode requests and padding requests exit at once. Slots run in reverse order so the long (late,
causal) tiles start first.

Ragged tiles: the 64 rows of a warpgroup may run past its request's last token (into the next request, or
past T, which the TMA reads as zeros). Those rows are computed and dropped: the result goes to shared
memory and back to HBM in at most 7 TMA stores of 64, 32, ..., 1 rows (the binary digits of the number of
valid rows), so no other request's rows are ever written.

Limits (the caller falls back to the Triton kernel outside them): q and cache of the same 16-bit dtype (no
fp8 cache), head_dim a multiple of 64 whose tiles fit shared memory (64 and 128), no soft-cap, no sliding window, ``block_kv`` a multiple of
the cache's block size.
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

ROWS_PER_WG = 64          # one wgmma M
COMPUTE_WGS = 2
TILE = ROWS_PER_WG * COMPUTE_WGS
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)   # finite: a fully masked row stays NaN-free
LOG2E = math.log2(math.e)


SMEM_BYTES = 227 * 1024   # Hopper's shared memory per block


def smem_bytes(d: int, block_kv: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory of one program: Q and the output buffer per compute warpgroup, ``stages`` K and V tiles."""
    return (2 * COMPUTE_WGS * ROWS_PER_WG * d + 2 * stages * block_kv * d) * itemsize


def supported(q, k_cache, *, soft_cap=None, sliding_window=None, k_scale=None, v_scale=None,
              block_kv: int = 128, stages: int = 2) -> bool:
    """Whether ``prefill_attention`` handles this call (else use the Triton prefill tiles). head_dim 256 does
    not fit shared memory (384 KiB at block_kv 128, 2 stages)."""
    d = q.shape[-1]
    bs = k_cache.shape[1]
    return (q.dtype in (jnp.bfloat16, jnp.float16) and k_cache.dtype == q.dtype and d % 64 == 0
            and smem_bytes(d, block_kv, stages, q.dtype.itemsize) <= SMEM_BYTES
            and soft_cap is None and sliding_window is None and k_scale is None and v_scale is None
            and block_kv % bs == 0)


def _find_request(qsl_ref, slot, num_reqs):
    """The request owning tile slot ``slot`` (binary search over ``qsl[r] // TILE + r``)."""
    lo, hi = jnp.int32(0), jnp.int32(num_reqs - 1)
    for _ in range(max(1, (num_reqs - 1).bit_length())):
        mid = (lo + hi + 1) // 2
        ok = qsl_ref[mid] // TILE + mid <= slot
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    return lo


def _kernel(meta_ref, q_ref, k_ref, v_ref, out_ref, scoped, *, n_slots, num_reqs, pages_per_seq, group,
            block_kv, stages, sm_scale):
    smem, kv_ready, consumed, q_ready, sched = scoped
    q_smem, k_smem, v_smem, o_smem, p_smem = smem
    k_ready, v_ready = kv_ready
    k_free, v_free = consumed
    wg = lax.axis_index("wg")
    qh = lax.axis_index("heads")
    h = qh // group
    slot_id = n_slots - 1 - lax.axis_index("tiles")        # long causal tiles first
    _, bs, _, d = k_ref.shape
    pages = block_kv // bs
    dtype = q_ref.dtype

    # meta = [query_start_loc (R+1), seq_lens (R), num_seqs (1), block_tables (R*P)]
    qsl_ref = meta_ref.at[pl.ds(0, num_reqs + 1)]
    seq_lens_ref = meta_ref.at[pl.ds(num_reqs + 1, num_reqs)]
    num_seqs_ref = meta_ref.at[pl.ds(2 * num_reqs + 1, 1)]
    bt_ref = meta_ref.at[pl.ds(2 * num_reqs + 2, num_reqs * pages_per_seq)]
    r = _find_request(qsl_ref, slot_id, num_reqs)
    q_start, q_end = qsl_ref[r], qsl_ref[r + 1]
    start = q_start + (slot_id - (q_start // TILE + r)) * TILE
    active = (r < num_seqs_ref[0]) & (q_end - q_start > 1) & (start < q_end)
    ctx = seq_lens_ref[r] - (q_end - q_start)               # cached tokens before the new ones

    def wg_range(w):
        """Rows, positions and K/V steps of compute warpgroup ``w``."""
        row0 = start + w * ROWS_PER_WG
        n_valid = jnp.clip(q_end - row0, 0, ROWS_PER_WG)
        first_pos = ctx + (row0 - q_start)
        last_pos = first_pos + n_valid - 1
        kv_steps = jnp.where(n_valid > 0, (last_pos + block_kv) // block_kv, 0)
        return row0, n_valid, first_pos, kv_steps

    max_steps = jnp.maximum(wg_range(0)[3], wg_range(1)[3])

    def schedule_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(active & (wg < COMPUTE_WGS))
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        row0, n_valid, first_pos, kv_steps = wg_range(wg)
        full_steps = jnp.minimum((first_pos + 1) // block_kv, kv_steps)   # below every row's diagonal
        # Q: the tile's first row is anywhere (ragged), and a TMA into the swizzled MMA layout needs a row
        # offset divisible by its 8-row tiling; so the rows land in the plain output buffer first and are
        # moved into the MMA layout through registers (once per tile).
        qs, os_ = q_smem.at[wg], o_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, ROWS_PER_WG), qh], os_, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        qs[...] = plgpu.load(os_, layout=plgpu.Layout.WGMMA, optimized=False)
        plgpu.commit_smem()

        m = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, d), jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(kv_steps > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(schedule_barrier)          # start the ping-pong half a step apart

        def step(i, carry, masked):
            acc, m, l = carry
            slot = lax.rem(i, stages)

            def qk_mma(acc_ref):
                plgpu.wgmma(acc_ref, qs, k_smem.at[slot].transpose((1, 0)))
                schedule_barrier()
                return acc_ref[...]
            s = pl.run_scoped(qk_mma, plgpu.ACC((ROWS_PER_WG, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * (sm_scale * LOG2E)
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(rows + first_pos >= cols + i * block_kv, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            plgpu.barrier_arrive(sched)             # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(sched)               # the other warpgroup's MMA is issued

            if p_smem is not None:                  # interpret mode: the MMA's A operand from shared memory
                p_smem.at[wg][...] = p16
                p_op = p_smem.at[wg]
            else:                                   # the GPU: straight from registers
                p_op = p16

            def pv_mma(acc_ref):
                plgpu.wgmma(acc_ref, p_op, v_smem.at[slot])

                @pl.when(i + 1 < kv_steps)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(i + 1, stages)])
            if p_smem is None:                      # the MMA adds into acc
                acc = pl.run_state(pv_mma)(plgpu.ACC.init(acc))
            else:                                   # interpret mode has no run_state: a fresh ACC, then add
                def pv_fresh(acc_ref):
                    pv_mma(acc_ref)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((ROWS_PER_WG, d), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = (acc, m, l)
        carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), carry)
        acc, m, l = lax.fori_loop(full_steps, kv_steps, functools.partial(step, masked=True), carry)

        @pl.loop(kv_steps, max_steps)
        def _drain(i):                              # steps the other warpgroup still needs
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_ready.at[slot])    # (observed, so every barrier phase is seen by all)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            schedule_barrier()
            schedule_barrier()

        pl.when(wg == 0)(schedule_barrier)

        l_safe = jnp.where(l > 0, l, 1.0)
        acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        os_[...] = acc.astype(dtype)
        plgpu.commit_smem()
        _store_rows(os_, out_ref, row0, qh, n_valid)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(active & (wg == COMPUTE_WGS))
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        base = r * pages_per_seq

        def load(ref, buf, bar, step, slot):
            for j in range(pages):
                page = bt_ref[base + jnp.minimum(step * pages + j, pages_per_seq - 1)]
                plgpu.copy_gmem_to_smem(ref.at[page, :, h], buf.at[slot, pl.ds(j * bs, bs)], bar.at[slot])

        for i in range(stages):
            @pl.when(i < max_steps)
            def _():
                load(k_ref, k_smem, k_ready, i, i)
                load(v_ref, v_smem, v_ready, i, i)

        # (Reading each step's page ids once for K and V, before the wait, measured slower: 410 against
        # 435 TFLOP/s on 8 x 2048, H200, 2026-11-30.)
        @pl.loop(0, jnp.maximum(max_steps - stages, 0))
        def _stream(i):
            step = i + stages
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_free.at[slot])
            load(k_ref, k_smem, k_ready, step, slot)
            plgpu.barrier_wait(v_free.at[slot])
            load(v_ref, v_smem, v_ready, step, slot)

        @pl.loop(jnp.maximum(max_steps - stages, 0), max_steps)
        def _last(i):                               # the last steps' release, so no barrier phase goes unseen
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


def _store_rows(src, out_ref, row0, qh, n_valid):
    """TMA-store the first ``n_valid`` rows of ``src [64, D]`` to ``out[row0:row0+n_valid, qh]``: one store
    when all 64 are valid, else one per set bit of ``n_valid`` (32, 16, ..., 1 rows)."""
    @pl.when(n_valid == ROWS_PER_WG)
    def _():
        plgpu.copy_smem_to_gmem(src, out_ref.at[pl.ds(row0, ROWS_PER_WG), qh], commit_group=False)

    b = ROWS_PER_WG // 2
    while b >= 1:
        @pl.when((n_valid < ROWS_PER_WG) & ((n_valid & b) != 0))
        def _(b=b):
            off = (n_valid // (2 * b)) * (2 * b)
            plgpu.copy_smem_to_gmem(src.at[pl.ds(off, b)], out_ref.at[pl.ds(row0 + off, b), qh], commit_group=False)
        b //= 2
    plgpu.commit_smem_to_gmem_group()


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "stages", "interpret"))
def prefill_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float, block_kv: int = 128,
                      stages: int = 2, interpret: bool = False):
    """Output ``[T, Hq, D]`` whose prefill tokens' rows hold their attention (other rows: unwritten).

    ``q [T, Hq, D]``, caches ``[num_blocks, block_size, kv_heads, D]`` (the new tokens' K/V already
    written). ``interpret``: run on CPU in Mosaic GPU's interpret mode (unwritten memory reads as NaN).
    """
    T, hq, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    R, P = md.block_tables.shape
    if hq % kvh:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({kvh})")
    if block_kv % bs:
        raise ValueError(f"block_kv ({block_kv}) must be a multiple of the cache block size ({bs})")
    n_slots = T // TILE + R
    # One fresh metadata buffer: Mosaic GPU kernels take only 256-byte-aligned inputs, and the engine's step
    # arrays are slices of one packed host transfer (H200, 2026-11-30: "Input buffer 3 is not 256-byte
    # aligned" for the block tables passed as they were).
    meta = jnp.concatenate([md.query_start_loc.astype(jnp.int32), md.seq_lens.astype(jnp.int32),
                            md.num_seqs.reshape(1).astype(jnp.int32),
                            md.block_tables.reshape(R * P).astype(jnp.int32)])
    ins = (meta, q, k_cache, v_cache)
    tiling = plgpu.TilingTransform((8, 128 // q.dtype.itemsize))
    swizzle = plgpu.SwizzleTransform(128)
    mma_tile = dict(transforms=(tiling, swizzle))
    kw = dict(n_slots=n_slots, num_reqs=R, pages_per_seq=P, group=hq // kvh, block_kv=block_kv, stages=stages,
              sm_scale=float(sm_scale))
    pages = block_kv // bs

    def entry(*refs):
        in_refs, out_ref = refs[:4], refs[4]
        pl.run_scoped(
            lambda *scoped: _kernel(*in_refs, out_ref, scoped, **kw),
            (plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, d), q.dtype, **mma_tile),
             plgpu.SMEM((stages, block_kv, d), k_cache.dtype, **mma_tile),
             plgpu.SMEM((stages, block_kv, d), v_cache.dtype, **mma_tile),
             plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, d), q.dtype),
             plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, block_kv), q.dtype, **mma_tile) if interpret else None),
            (plgpu.Barrier(num_arrivals=pages, num_barriers=stages),) * 2,
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    params = plgpu.InterpretGPUParams() if interpret else None
    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((T, hq, d), q.dtype), grid=(hq, n_slots),
        grid_names=("heads", "tiles"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=params,
    )(*ins)
