"""Paged causal prefill attention for Hopper in Pallas Mosaic GPU (TMA, wgmma, warp specialisation).

Computes the output rows of the step's **prefill tokens** (requests with ``q_len > 1``) of
``ragged_paged_attention``; decode tokens and padding are left to the caller (``paged_attention_pallas``
runs its Triton decode launch into the same buffer). Every prefill token attends causally to its request's
whole context through the block table, cached prefix included, so chunked prefill and prefix-cache hits
take the same path as a fresh prompt.

Why a second backend for prefill: prefill is compute-bound, and the Triton lowering topped out at about half
the stock dense Mosaic GPU flash attention's TFLOP/s on long causal prompts (kernels/README.md has the
figures). Mosaic GPU gives Hopper's asynchronous tensor-core MMA (wgmma) and the TMA copy engine, so one
warpgroup can stream K/V while two others compute.

Layout of one program (three warpgroups of 128 threads), for each work item (one 128-token tile of one q
head):
* two **compute warpgroups**, each owning 64 query rows (one wgmma M) of the tile's 128 tokens for one q
  head; they alternate their tensor-core phases through a shared barrier (one does QK^T while the other
  does its softmax), the FA3 ping-pong;
* one **memory warpgroup** streaming the K/V of the tile's kv head through ``stages`` shared-memory slots.
  A K/V step of ``block_kv`` keys is ``block_kv / block_size`` pages, one TMA copy per page (the page ids
  read from the block table as scalars; a head's page is one contiguous ``[block_size, D]`` run), all landing on the slot's barrier.

Tile schedule (no XLA pre-pass): request r owns slots ``[qsl[r] // 128 + r, qsl[r+1] // 128 + r + 1)``;
a program finds its request by binary search over that monotone start. Slots past a request's tokens,
decode requests and padding requests are empty items.

Persistent programs: ``num_programs`` programs (132, one per H200 SM) each loop over work items: item j is
tile slot ``order[j // Hq]`` for q head ``j % Hq`` (a slot's q heads adjacent, so the items running at once read the same kv heads' pages, from L2). ``order`` sorts the slots by their K/V
steps, most first (``slot_order``, a few XLA ops on the step metadata), and the items are dealt to the
programs in snake order (round t: ``t * P + pid``, or ``t * P + P - 1 - pid`` when t is odd). Balance,
simulated with one step of overhead per item: the busiest program within 3 % of the balanced bound for
1 x 2048, 2 x 1024, 4 x 512 and 8 x 2048 tokens, where slot order dealt round-robin is 19 / 31 / 47 / 3 %
over it (a step of the engine holds up to max_num_batched_tokens, so a few requests' tiles). What a program
does not pay per item, against one program per tile: the block launch, the Q load's latency, the first K/V
steps' latency and the wait for the output store. The protocol across items:
* every warpgroup walks the same item list; an empty item (past its request, a decode, padding) touches
  no barrier and has 0 K/V steps, so its cost is the search;
* K/V steps are numbered across the program's items (step g in slot ``g % stages``): the memory warpgroup
  loads the next item's first steps as soon as the current item's last steps release their slots, and
  every party observes every phase of every barrier once, in order (Pallas tracks the phase implicitly);
* each compute warpgroup arrives at the ping-pong barrier ``2 * steps + 1`` times per item;
* Q comes one item ahead into a staging buffer of its own (issued once the current Q has moved into the
  MMA layout): 224 KiB of shared memory of 227 at head_dim 128, block_kv 128, 2 stages. The previous
  item's output store is waited for only before its buffer is written again.

Diagonal steps: a warpgroup's last K/V step is half-width (``block_kv / 2`` keys in its wgmmas, mask and
softmax; same barriers) when no row of the warpgroup sees the step's second half, as (at block_kv 128) on
every diagonal step of the first warpgroup of a 128-aligned tile (a few percent on long causal prompts).
block_kv a multiple of 128 only (the P.V wgmma's K must be a multiple of 64).

Ragged tiles: the 64 rows of a warpgroup may run past its request's last token (into the next request, or
past T, which the TMA reads as zeros). Those rows are computed and dropped: the result goes to shared
memory and back to HBM in at most 7 TMA stores of 64, 32, ..., 1 rows (the binary digits of the number of
valid rows), so no other request's rows are ever written.

Limits (the caller falls back to the Triton kernel outside them): q and cache of the same 16-bit dtype (no
fp8 cache), head_dim a multiple of 64 whose tiles fit shared memory (64 and 128), no soft-cap, no sliding
window, ``block_kv`` a multiple of the cache's block size.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

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
    """Shared memory of one program: Q, its staging buffer and the output buffer per compute warpgroup,
    ``stages`` K and V tiles."""
    return (3 * COMPUTE_WGS * ROWS_PER_WG * d + 2 * stages * block_kv * d) * itemsize


def supported(q, k_cache, *, soft_cap=None, sliding_window=None, k_scale=None, v_scale=None,
              block_kv: int = 128, stages: int = 2) -> bool:
    """Whether ``prefill_attention`` handles this call (else use the Triton prefill tiles): head_dim 128 fits
    shared memory at block_kv 128 and 2 stages (224 KiB), head_dim 256 does not."""
    d = q.shape[-1]
    bs = k_cache.shape[2]
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


class _Item(NamedTuple):
    """One work item: the 128-token tile ``start`` of request ``r`` for q head ``qh``."""
    qh: jax.Array
    r: jax.Array
    q_start: jax.Array
    q_end: jax.Array
    start: jax.Array
    ctx: jax.Array          # cached tokens before the request's new ones
    active: jax.Array       # a prefill tile with rows to compute (else: nothing to do, no barrier touched)


def _kernel(meta_ref, q_ref, k_ref, v_ref, out_ref, scoped, *, n_slots, num_reqs, pages_per_seq, group,
            block_kv, stages, sm_scale, num_programs):
    smem, kv_ready, consumed, q_ready, sched = scoped
    q_smem, k_smem, v_smem, o_smem, q_stage, p_smem = smem
    k_ready, v_ready = kv_ready
    k_free, v_free = consumed
    wg = lax.axis_index("wg")
    _, _, bs, d = k_ref.shape
    hq = q_ref.shape[1]
    pages = block_kv // bs
    dtype = q_ref.dtype

    # meta = [query_start_loc (R+1), seq_lens (R), num_seqs (1), block_tables (R*P), slot order (n_slots)]
    qsl_ref = meta_ref.at[pl.ds(0, num_reqs + 1)]
    seq_lens_ref = meta_ref.at[pl.ds(num_reqs + 1, num_reqs)]
    num_seqs_ref = meta_ref.at[pl.ds(2 * num_reqs + 1, 1)]
    bt_ref = meta_ref.at[pl.ds(2 * num_reqs + 2, num_reqs * pages_per_seq)]
    order_ref = meta_ref.at[pl.ds(2 * num_reqs + 2 + num_reqs * pages_per_seq, n_slots)]

    # The items of this program, t = 0 .. n_items - 1: the (tile slot, q head) pairs, slots in ``order``
    # (most K/V steps first) and a slot's q heads adjacent, so the items running at once share kv heads' K/V
    # in L2; dealt in snake order: round t gives item t * P + pid when t is even and t * P + P - 1 - pid
    # when odd, so a program that got a round's heaviest item gets the next round's lightest.
    pid = lax.axis_index("progs")
    n_items = snake_count(pid, num_programs, hq * n_slots)

    def coords(t):
        j = snake_item(t, pid, num_programs)
        return j % hq, order_ref[jnp.minimum(j // hq, n_slots - 1)]   # (past the end: inactive anyway)

    def find(t):
        """The request of item ``t``'s slot (a chain of dependent loads: searched once per item and warpgroup)."""
        return _find_request(qsl_ref, coords(t)[1], num_reqs)

    def item(t, r):
        qh, slot_id = coords(t)
        q_start, q_end = qsl_ref[r], qsl_ref[r + 1]
        start = q_start + (slot_id - (q_start // TILE + r)) * TILE
        active = (t < n_items) & (r < num_seqs_ref[0]) & (q_end - q_start > 1) & (start < q_end)
        return _Item(qh, r, q_start, q_end, start, seq_lens_ref[r] - (q_end - q_start), active)

    def wg_range(it, w):
        """Rows, positions and K/V steps of compute warpgroup ``w`` in item ``it``."""
        row0 = it.start + w * ROWS_PER_WG
        n_valid = jnp.clip(it.q_end - row0, 0, ROWS_PER_WG)
        first_pos = it.ctx + (row0 - it.q_start)
        last_pos = first_pos + n_valid - 1
        kv_steps = jnp.where(n_valid > 0, (last_pos + block_kv) // block_kv, 0)
        return row0, n_valid, first_pos, kv_steps

    def max_steps(it):
        """K/V steps of the item: every warpgroup observes all of them (0 for an inactive item)."""
        return jnp.where(it.active, jnp.maximum(wg_range(it, 0)[3], wg_range(it, 1)[3]), 0)

    def items_loop(body, carry):
        """``carry = body(t, carry)`` over this program's items."""
        return lax.fori_loop(0, n_items, body, carry)

    # K/V steps are numbered across the program's items (g): step g uses slot g % stages, so the memory
    # warpgroup streams on into the next item as slots free up and every barrier phase is observed in order.

    def schedule_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qs, os_ = q_smem.at[wg], o_smem.at[wg]
        # Q: the tile's first row is anywhere (ragged), and a TMA into the swizzled MMA layout needs a row
        # offset divisible by its 8-row tiling; so the rows land in a plain staging buffer first, loaded one
        # item ahead, and are moved into the MMA layout through registers (once per tile).
        qbuf = q_stage.at[wg]

        def fetch_q(it):
            @pl.when(it.active)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(it.start + wg * ROWS_PER_WG, ROWS_PER_WG), it.qh], qbuf,
                                        q_ready.at[wg])

        def compute_item(it, g, n_steps):
            """Item ``it``, its K/V steps numbered from ``g``."""
            row0, n_valid, first_pos, kv_steps = wg_range(it, wg)
            full_steps = jnp.minimum((first_pos + 1) // block_kv, kv_steps)   # below every row's diagonal
            m = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, d), jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[lax.rem(g, stages)])

            pl.when(wg == 1)(schedule_barrier)          # start the ping-pong half a step apart

            def step(i, carry, masked, width=block_kv):
                """K/V step i over its first ``width`` keys (block_kv, or half of it on a diagonal step whose
                second half no row of this warpgroup sees)."""
                acc, m, l = carry
                slot = lax.rem(g + i, stages)
                k_op = k_smem.at[slot] if width == block_kv else k_smem.at[slot, pl.ds(0, width)]
                v_op = v_smem.at[slot] if width == block_kv else v_smem.at[slot, pl.ds(0, width)]

                def qk_mma(acc_ref):
                    plgpu.wgmma(acc_ref, qs, k_op.transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]
                s = pl.run_scoped(qk_mma, plgpu.ACC((ROWS_PER_WG, width), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(rows + first_pos >= cols + i * block_kv, s, MASK_VALUE)
                # Raw scores; the softmax scale (base 2) goes into exp2's argument (s * c - m: one multiply-add per
                # score, no separate scaling pass). The running max m is kept scaled.
                c = sm_scale * LOG2E
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(sched)             # softmax done
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(sched)               # the other warpgroup's MMA is issued

                if p_smem is not None:                  # interpret mode: the MMA's A operand from shared memory
                    p_op = p_smem.at[wg] if width == block_kv else p_smem.at[wg, :, pl.ds(0, width)]
                    p_op[...] = p16
                else:                                   # the GPU: straight from registers
                    p_op = p16

                def pv_mma(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v_op)

                    @pl.when(i + 1 < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(g + i + 1, stages)])
                if p_smem is None:                      # the MMA adds into acc
                    acc = pl.run_state(pv_mma)(plgpu.ACC.init(acc))
                else:                                   # interpret mode has no run_state: a fresh ACC, then add
                    def pv_fresh(acc_ref):
                        pv_mma(acc_ref)
                        return acc_ref[...]
                    acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((ROWS_PER_WG, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            # The last step is half-width when this warpgroup's last row is in its first half (at block_kv 128:
            # every diagonal step of a 128-aligned tile's first warpgroup): that step's wgmmas, mask and softmax
            # run on block_kv / 2 keys. (Such a step is never below the diagonal, so it is a masked one.) The
            # P.V wgmma needs K a multiple of 64, so block_kv a multiple of 128.
            half = block_kv // 2
            halves = block_kv % 128 == 0
            n_wide = kv_steps
            if halves:
                last_half = (kv_steps > 0) & (first_pos + n_valid - 1 - (kv_steps - 1) * block_kv < half)
                n_wide = kv_steps - jnp.where(last_half, 1, 0)
            carry = (acc, m, l)
            carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(full_steps, n_wide, functools.partial(step, masked=True), carry)
            if halves:
                carry = lax.fori_loop(n_wide, kv_steps, functools.partial(step, masked=True, width=half), carry)
            acc, m, l = carry

            @pl.loop(kv_steps, n_steps)
            def _drain(i):                              # steps the other warpgroup still needs
                slot = lax.rem(g + i, stages)
                plgpu.barrier_wait(k_ready.at[slot])    # (observed, so every barrier phase is seen by all)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            pl.when(wg == 0)(schedule_barrier)          # (so both arrive 2 * n_steps + 1 times per item)

            l_safe = jnp.where(l > 0, l, 1.0)
            acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous item's store has read the buffer
            os_[...] = acc.astype(dtype)
            plgpu.commit_smem()
            _store_rows(os_, out_ref, row0, it.qh, n_valid)

        def body(t, carry):
            g, r = carry
            it = item(t, r)

            @pl.when(it.active)
            def _():
                plgpu.barrier_wait(q_ready.at[wg])
                qs[...] = plgpu.load(qbuf, layout=plgpu.Layout.WGMMA, optimized=False)
                plgpu.commit_smem()             # (also: every thread has read qbuf before it is refilled)

            r_next = find(t + 1)                # the next item's Q, while this one computes
            fetch_q(item(t + 1, r_next))
            n_steps = max_steps(it)             # (here: the scalars it comes from need not live through the item)
            pl.when(it.active)(functools.partial(compute_item, it, g, n_steps))
            return g + n_steps, r_next

        r0 = find(0)
        fetch_q(item(0, r0))
        items_loop(body, (0, r0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def body(t, g):
            it = item(t, find(t))
            base = it.r * pages_per_seq
            h = it.qh // group

            def load(ref, buf, bar, step, slot):
                for j in range(pages):
                    page = bt_ref[base + jnp.minimum(step * pages + j, pages_per_seq - 1)]
                    plgpu.copy_gmem_to_smem(ref.at[page, h], buf.at[slot, pl.ds(j * bs, bs)], bar.at[slot])

            n_steps = max_steps(it)

            # (Reading each step's page ids once for K and V, before the wait, measured slower.)
            @pl.loop(0, n_steps)
            def _stream(i):
                slot = lax.rem(g + i, stages)
                pl.when(g + i >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))   # step g + i - stages
                load(k_ref, k_smem, k_ready, i, slot)
                pl.when(g + i >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                load(v_ref, v_smem, v_ready, i, slot)
            return g + n_steps

        g = items_loop(body, 0)

        @pl.loop(jnp.maximum(g - stages, 0), g)
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


def snake_item(t, pid, num_programs):
    """The item a program takes in its round ``t`` of the snake deal (rounds alternate direction)."""
    return t * num_programs + jnp.where(t % 2 == 0, pid, num_programs - 1 - pid)


def snake_count(pid, num_programs, n_all):
    """How many of the ``n_all`` items the snake deal gives program ``pid`` (one more in the partial round
    if its position in that round's direction falls inside it)."""
    last = n_all // num_programs
    k_last = jnp.where(last % 2 == 0, pid, num_programs - 1 - pid)
    return last + jnp.where(k_last < n_all - last * num_programs, 1, 0)


def slot_order(md: AttentionMetadata, n_slots: int, block_kv: int):
    """The tile slots ``[n_slots]`` sorted by their K/V steps, most first (empty slots last): the order in
    which the persistent programs take them. Slot s belongs to the request found as ``_find_request`` finds
    it; its steps reach the tile's last token (cached prefix included)."""
    qsl = md.query_start_loc.astype(jnp.int32)
    R = md.seq_lens.shape[0]
    s = jnp.arange(n_slots, dtype=jnp.int32)
    starts = qsl[:R] // TILE + jnp.arange(R, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(starts, s, side="right") - 1, 0, R - 1)
    q_start, q_end = qsl[r], qsl[r + 1]
    start = q_start + (s - starts[r]) * TILE
    active = (r < md.num_seqs) & (q_end - q_start > 1) & (start < q_end)
    last = md.seq_lens.astype(jnp.int32)[r] - (q_end - jnp.minimum(start + TILE, q_end))   # keys seen
    steps = jnp.where(active, (last + block_kv - 1) // block_kv, 0)
    return jnp.argsort(-steps, stable=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "stages", "interpret", "num_programs"))
def prefill_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float, block_kv: int = 128,
                      stages: int = 2, interpret: bool | plgpu.InterpretGPUParams = False,
                      num_programs: int = 132):
    """Output ``[T, Hq, D]`` whose prefill tokens' rows hold their attention (other rows: unwritten).

    ``q [T, Hq, D]``, caches ``[num_blocks, kv_heads, block_size, D]`` (the new tokens' K/V already
    written). ``interpret``: run on CPU in Mosaic GPU's interpret mode (unwritten memory reads as NaN), or
    a ``plgpu.InterpretGPUParams`` for its options (the tests use ``detect_races=True``).
    ``num_programs`` programs (default: the H200's 132 SMs) loop over the work items. Call only where
    ``supported``.
    """
    T, hq, d = q.shape
    nb, kvh, bs, _ = k_cache.shape
    R, P = md.block_tables.shape
    if hq % kvh:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({kvh})")
    if block_kv % bs:
        raise ValueError(f"block_kv ({block_kv}) must be a multiple of the cache block size ({bs})")
    if num_programs < 1:
        raise ValueError(f"num_programs must be positive, got {num_programs}")
    n_slots = T // TILE + R
    # One fresh metadata buffer: Mosaic GPU kernels take only 256-byte-aligned inputs ("Input buffer 3 is not
    # 256-byte aligned"), and the engine's step arrays are slices of one packed host transfer.
    meta = jnp.concatenate([md.query_start_loc.astype(jnp.int32), md.seq_lens.astype(jnp.int32),
                            md.num_seqs.reshape(1).astype(jnp.int32),
                            md.block_tables.reshape(R * P).astype(jnp.int32), slot_order(md, n_slots, block_kv)])
    ins = (meta, q, k_cache, v_cache)
    tiling = plgpu.TilingTransform((8, 128 // q.dtype.itemsize))
    swizzle = plgpu.SwizzleTransform(128)
    mma_tile = dict(transforms=(tiling, swizzle))
    num_programs = min(num_programs, hq * n_slots)
    kw = dict(n_slots=n_slots, num_reqs=R, pages_per_seq=P, group=hq // kvh, block_kv=block_kv, stages=stages,
              sm_scale=float(sm_scale), num_programs=num_programs)
    pages = block_kv // bs
    if isinstance(interpret, plgpu.InterpretGPUParams):
        params = interpret
    else:
        params = plgpu.InterpretGPUParams() if interpret else None

    def entry(*refs):
        in_refs, out_ref = refs[:4], refs[4]
        pl.run_scoped(
            lambda *scoped: _kernel(*in_refs, out_ref, scoped, **kw),
            (plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, d), q.dtype, **mma_tile),
             plgpu.SMEM((stages, block_kv, d), k_cache.dtype, **mma_tile),
             plgpu.SMEM((stages, block_kv, d), v_cache.dtype, **mma_tile),
             plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, d), q.dtype),
             plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, d), q.dtype),
             plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, block_kv), q.dtype, **mma_tile) if params is not None else None),
            (plgpu.Barrier(num_arrivals=pages, num_barriers=stages),) * 2,
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((T, hq, d), q.dtype), grid=(num_programs,),
        grid_names=("progs",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=params,
    )(*ins)
