"""Grouped (ragged) matmul for mixture-of-experts layers, three ways, and its jnp reference.

``grouped_matmul(lhs [m, k], rhs [G, k, n], group_sizes [G], impl)`` -> ``[m, n]``: rows are sorted by group,
the first ``group_sizes[0]`` rows use ``rhs[0]``, the next ``group_sizes[1]`` use ``rhs[1]``, and so on. Rows
past ``sum(group_sizes)`` come out zero: the MoE layer sorts there what this device does not compute (padding
tokens, another device's experts under expert parallelism), so an implementation that skips them spends
nothing on them. Products accumulate in float32 and come out in ``lhs.dtype``.

Implementations (``IMPLEMENTATIONS``; the MoE layer takes one by name; benchmarks/kernel_bench.py times
them on the GPU against each other):

- ``ragged_dot``: ``jax.lax.ragged_dot``. On CPU (and reportedly on GPU) XLA expands it to a masked product
  over every group, ``G`` times the work; correct everywhere, the CPU default.
- ``gather``: every row gathers its group's ``[k, n]`` matrix and a batched GEMV multiplies them. Reads just
  the selected experts' weights; for decode-sized ``m`` (at most ``m`` distinct experts) it is the
  bandwidth-bound shape. Its gathered copy makes it useless for large ``m``.
- ``pallas``: a Pallas Triton kernel over row tiles aligned to groups (each group's rows split into tiles of
  ``block_m``, so every tile multiplies by one expert's matrix; a tile plan computed in jnp says which). One
  program per (tile, ``block_n`` columns); tiles past the plan exit at once. Runs in interpret mode on CPU.

``expert_rows_matmul(lhs [m, k], rhs [G, k, n], row_expert [m], max_rows_per_expert)`` -> ``[m, n]``:
``out[r] = lhs[r] @ rhs[row_expert[r]]`` for rows in any order, a row whose expert is outside ``0 .. G-1``
zero and free. The same kernel over a plan with one tile per distinct expert, its tile gathering all the
rows of that expert (at most ``max_rows_per_expert``, the tile height), so each selected expert's weights
are read once and nothing is sorted, counted or scattered back: the MoE layer passes its (token, slot) rows
in token order. The plan compares every row with every row (``m²``), so it is for decode-sized ``m``;
``expert_rows_plan`` makes it once for several products of the same rows. ``expert_rows_matmul_fused`` is the
same product in one launch, each program making its tile from the ids; given a shared MLP's weights (``shared``:
DeepSeek's shared experts, Qwen2-MoE's shared expert) that MLP rides along as S more experts of the routed
ones' width, which every real token selects: S more rows a token in the same launch, their sum the MLP's output.

Gated (``activation``, the MoE's gate/up product): ``rhs [G, k, 2n]`` holds each expert's gate columns then its
up columns, and the result is ``activation(gate) * up`` ``[m, n]`` (``gated`` on the plain product: the
reference). The Pallas kernel computes it in place, each program accumulating a block of gate columns and the
same block of up columns, so the ``[m, 2n]`` product is never written and read back.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .device_info import SHARED_MEMORY

IMPLEMENTATIONS = ("ragged_dot", "gather", "pallas")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, impl: str = "ragged_dot", *,
                   activation: Callable | None = None, interpret: bool = False) -> jax.Array:
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "pallas":   # Triton lowers for NVIDIA GPUs; elsewhere the kernel runs in interpret mode
        return grouped_matmul_pallas(lhs, rhs, group_sizes, activation=activation,
                                     interpret=interpret or jax.default_backend() != "gpu")
    if impl == "ragged_dot":
        out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)
    elif impl == "gather":
        out = grouped_matmul_gather(lhs, rhs, group_sizes)
    else:
        raise ValueError(f"grouped matmul implementation {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return out if activation is None else gated(out, activation)


def gated(product: jax.Array, activation: Callable) -> jax.Array:
    """``activation(gate) * up`` of a gate-then-up product ``[m, 2n]`` → ``[m, n]``."""
    product = product.reshape(product.shape[0], 2, -1)
    return activation(product[:, 0]) * product[:, 1]


def count_ends_at_or_below(ends: jax.Array, x: jax.Array) -> jax.Array:
    """``searchsorted(ends, x, side="right")`` for a short sorted ``ends``, as one compare-and-count fusion.
    jnp's default search is a ``while`` loop of log2(len) steps, and a device loop costs a kernel launch (and
    on GPU a predicate read back by the host) per step: inside every MoE layer of a decode step that was
    most of the step's time."""
    return jnp.sum(x[..., None] >= ends, axis=-1, dtype=jnp.int32)


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """The group of each of ``m`` sorted rows; ``G`` for rows past the last group."""
    return count_ends_at_or_below(jnp.cumsum(group_sizes), jnp.arange(m, dtype=jnp.int32))


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The obvious definition: each group's dense product, masked to its rows."""
    groups = row_groups(group_sizes.astype(jnp.int32), lhs.shape[0])
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        prod = jnp.dot(lhs, rhs[g], preferred_element_type=jnp.float32)
        out = jnp.where((groups == g)[:, None], prod, out)
    return out.astype(lhs.dtype)


def grouped_matmul_gather(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    num_groups = rhs.shape[0]
    groups = row_groups(group_sizes, lhs.shape[0])
    w = jnp.take(rhs, jnp.minimum(groups, num_groups - 1), axis=0)             # [m, k, n]
    out = jnp.einsum("mk,mkn->mn", lhs, w, preferred_element_type=jnp.float32)
    return jnp.where((groups < num_groups)[:, None], out, 0).astype(lhs.dtype)


# ------------------------------------------------------------------------------------------ Pallas Triton
def tile_plan(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(group, first_row, num_rows)`` of each row tile, ``cdiv(m, block_m) + G`` tiles (the most any split
    of ``m`` rows into ``G`` groups needs); unused tiles have ``num_rows == 0``."""
    num_groups = group_sizes.shape[0]
    tiles_per_group = (group_sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles_per_group)
    group_row0 = jnp.cumsum(group_sizes) - group_sizes
    t = jnp.arange(pl.cdiv(m, block_m) + num_groups, dtype=jnp.int32)
    group = count_ends_at_or_below(tile_end, t)
    g = jnp.minimum(group, num_groups - 1)
    row0 = group_row0[g] + (t - (tile_end[g] - tiles_per_group[g])) * block_m
    rows = jnp.where(group < num_groups, jnp.minimum(block_m, group_row0[g] + group_sizes[g] - row0), 0)
    return g, row0.astype(jnp.int32), rows.astype(jnp.int32)


def _block(size: int, largest: int) -> int:
    """The largest power of two <= ``largest`` (and >= 16, Triton's smallest dot) dividing ``size``."""
    b = largest
    while b >= 16:
        if size % b == 0:
            return b
        b //= 2
    raise ValueError(f"grouped matmul (pallas): dimension {size} is not a multiple of 16")


def _gmm_kernel(group_ref, row0_ref, rows_ref, lhs_ref, rhs_ref, _out_in, out_ref, *, m, k, block_m, block_k,
                block_n, gathered, activation):
    t, j = pl.program_id(0), pl.program_id(1)
    num_rows = rows_ref[t]

    @pl.when(num_rows > 0)
    def _():
        g = group_ref[t]
        r = lax.iota(jnp.int32, block_m)
        # rows past the tile's own name row m: read as zeros (a masked load), written to a discarded row of out
        if gathered:     # row0_ref holds each tile's block_m row indices
            rows = plgpu.load(row0_ref.at[t * block_m + r])
        else:            # a run of num_rows rows from row0_ref[t]
            rows = jnp.where(r < num_rows, row0_ref[t] + r, m)
        cols = j * block_n + lax.iota(jnp.int32, block_n)
        out = _tile_product(lhs_ref, rhs_ref, out_ref, rows, rows < m, g * k, cols, k=k, block_k=block_k,
                            activation=activation)
        plgpu.store(out_ref.at[rows[:, None], cols[None, :]], out)


def _tile_product(lhs_ref, rhs_ref, out_ref, src, live, row0, cols, *, k, block_k, activation, half=None):
    """``lhs`` rows ``src`` (those not ``live`` read as zeros) times ``rhs_ref``'s rows ``row0 .. row0 + k``
    (expert g's: ``g * k``), columns ``cols``, in float32, gated when ``activation`` (the gate's columns and,
    ``half`` further on (default: out_ref's width), the up's), in out_ref's dtype."""
    block_m, block_n = src.shape[0], cols.shape[0]
    halves = (0,) if activation is None else (0, out_ref.shape[1] if half is None else half)

    def step(kb, accs):
        ks = kb * block_k + lax.iota(jnp.int32, block_k)
        x = plgpu.load(lhs_ref.at[src[:, None], ks[None, :]], other=0,
                       mask=jnp.broadcast_to(live[:, None], (block_m, block_k)))                # [bm, bk]
        return tuple(acc + plgpu.dot(x, plgpu.load(rhs_ref.at[(row0 + ks)[:, None], (cols + h)[None, :]]),
                                     allow_tf32=False)                                        # [bk, bn] each
                     for acc, h in zip(accs, halves))

    accs = lax.fori_loop(0, k // block_k, step, tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in halves))
    if activation is None:
        return accs[0].astype(out_ref.dtype)
    gate, up = (a.astype(out_ref.dtype).astype(jnp.float32) for a in accs)   # rounded as the plain product's
    return (activation(gate) * up).astype(out_ref.dtype)


def _auto_block_m(m: int, num_groups: int) -> int:
    """Rows per tile: about the mean group size, 16 to 128 — small tiles waste no rows at decode sizes, big
    ones read each expert's weights fewer times at prefill sizes."""
    return max(16, min(128, 1 << max(0, (max(1, m // num_groups) - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("block_m", "activation", "interpret"))
def grouped_matmul_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int | None = None,
                          activation: Callable | None = None, interpret: bool = False) -> jax.Array:
    m, k = lhs.shape
    block_m = block_m or _auto_block_m(m, rhs.shape[0])
    plan = tile_plan(group_sizes.astype(jnp.int32), m, block_m)
    # gated, a program holds two accumulators: half as many columns keeps its registers at the plain kernel's
    block_n = _block(_out_width(rhs, activation), 128 if activation is None else 64)
    return _tiles_matmul(lhs, rhs, plan, block_m=block_m, block_k=_block(k, 64), block_n=block_n, gathered=False,
                         activation=activation, interpret=interpret)


def _out_width(rhs: jax.Array, activation: Callable | None) -> int:
    return rhs.shape[2] // 2 if activation is not None else rhs.shape[2]


def gather_plan(row_expert: jax.Array, num_groups: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(group, row indices [m * block_m], num_rows)`` of ``expert_rows_matmul``'s tiles: tile r is live when
    row r is the first row of its expert and holds all that expert's rows, in order; the other slots (and
    every slot of a dead tile) name row m. Loop-free and scan-free, two reductions: one sum over an ``[m, m]``
    comparison gives each row its rank among its expert's rows and each expert's row count (packed as
    ``rank * (m + 1) + count``), an ``[m, block_m, m]`` selection each tile's rows (a min)."""
    m = row_expert.shape[0]
    mine = (row_expert >= 0) & (row_expert < num_groups)
    same = (row_expert[:, None] == row_expert[None, :]) & mine[None, :]       # symmetric: equal ids share mine
    rows = jnp.arange(m, dtype=jnp.int32)
    # each row of the expert counts 1, each earlier one m + 1 more
    packed = jnp.sum(jnp.where(same, jnp.where(rows[:, None] < rows[None, :], m + 2, 1), 0), axis=0,
                     dtype=jnp.int32)
    rank, count = lax.div(packed, m + 1), lax.rem(packed, m + 1)
    live = mine & (rank == 0)
    picks = same[:, None, :] & (rank[None, None, :] == jnp.arange(block_m, dtype=jnp.int32)[None, :, None])
    index = jnp.min(jnp.where(picks, rows[None, None, :], m), axis=2)                 # [m, block_m]
    index = jnp.where(live[:, None], index, m)
    num_rows = jnp.where(live, jnp.minimum(count, block_m), 0)
    return jnp.where(mine, row_expert, 0).astype(jnp.int32), index.reshape(-1), num_rows


def expert_rows_plan(row_expert: jax.Array, num_groups: int, max_rows_per_expert: int) -> tuple:
    """``expert_rows_matmul``'s tile plan for rows ``row_expert [m]`` over ``num_groups`` experts: a caller
    that multiplies the same rows twice (the MoE's gate/up, then down) computes it once and passes it to both."""
    return gather_plan(row_expert.astype(jnp.int32), num_groups, _rows_block(max_rows_per_expert))


def _rows_block(max_rows_per_expert: int) -> int:
    return max(16, 1 << (max_rows_per_expert - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("max_rows_per_expert", "activation", "interpret"))
def expert_rows_matmul(lhs: jax.Array, rhs: jax.Array, row_expert: jax.Array | None, max_rows_per_expert: int, *,
                       plan: tuple | None = None, activation: Callable | None = None,
                       interpret: bool = False) -> jax.Array:
    """See the module docstring; rows beyond ``max_rows_per_expert`` of one expert would be left out, so the
    caller must bound it (the MoE layer: each token sends at most one row to an expert, so its token count).
    ``plan``: ``expert_rows_plan(row_expert, G, max_rows_per_expert)`` made once for several products of the
    same rows (``row_expert`` is then unused). Narrow column blocks give a few live tiles enough programs to
    keep the memory system busy."""
    if plan is None:
        plan = expert_rows_plan(row_expert, rhs.shape[0], max_rows_per_expert)
    k = lhs.shape[1]
    return _tiles_matmul(lhs, rhs, plan, block_m=_rows_block(max_rows_per_expert), block_k=_block(k, 128),
                         block_n=_block(_out_width(rhs, activation), 64), gathered=True, activation=activation,
                         interpret=interpret or jax.default_backend() != "gpu")


ROWS_LAUNCH = (64, 128, 4, 3)     # the fused rows kernel's (block_n, block_k, num_warps, num_stages) bounds
ROWS_LAUNCH_GATED = (128, 128, 4, 3)     # and its gated (gate/up) product's: benchmarks/moe_rows_launch.py


def rows_launch(k: int, n: int, launch: tuple[int, int, int, int] | None = None, gated: bool = False, *,
                block_m: int = 16, itemsize: int = 2) -> tuple[int, int, int, int]:
    """``expert_rows_matmul_fused``'s launch for a ``[k, n]`` product (``n``: output columns, a gated product's
    half): the largest power-of-two blocks dividing ``k`` and ``n`` up to ``launch``'s (default ``ROWS_LAUNCH``,
    ``ROWS_LAUNCH_GATED`` for a gated product), ``block_k`` then halved until the tiles Triton stages fit an
    SM's shared memory: ``num_stages - 1`` copies of the ``block_m`` rows' and the weight columns' (both
    halves of a gated product) ``block_k``-deep tiles, ``itemsize`` bytes each. The 16-bit defaults fit as they
    are; in float32 the gated default asked for 272 KB on an H100 and did not compile."""
    block_n, block_k, warps, stages = launch or (ROWS_LAUNCH_GATED if gated else ROWS_LAUNCH)
    block_n, block_k = _block(n, block_n), _block(k, block_k)
    cols = block_n * (2 if gated else 1)
    while (stages - 1) * (block_m + cols) * block_k * itemsize > SHARED_MEMORY and block_k > 16:
        block_k //= 2
    return block_n, block_k, warps, stages


def parse_rows_launch(spec: str) -> tuple[int, int, int, int]:
    """``"64/128/4/3"`` -> ``(64, 128, 4, 3)``: BLOCK_N/BLOCK_K/WARPS/STAGES, each a power of two (stages: >= 1)."""
    parts = spec.strip().split("/")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts) or \
            not all(int(p) & (int(p) - 1) == 0 for p in parts[:3]) or min(int(p) for p in parts[:2]) < 16:
        raise ValueError(f"MoE rows launch {spec!r} is not BLOCK_N/BLOCK_K/WARPS/STAGES (powers of two, blocks >= 16)")
    return tuple(int(p) for p in parts)


@functools.partial(jax.jit, static_argnames=("max_rows_per_expert", "rows_per_lhs_row", "activation", "launch",
                                             "interpret"))
def expert_rows_matmul_fused(lhs: jax.Array, rhs: jax.Array, row_expert: jax.Array, max_rows_per_expert: int, *,
                             rows_per_lhs_row: int = 1, activation: Callable | None = None,
                             launch: tuple[int, int, int, int] | None = None, shared: jax.Array | None = None,
                             interpret: bool = False) -> jax.Array:
    """``expert_rows_matmul`` in one kernel launch: each program makes its own tile from ``row_expert`` (no
    plan ops before it), row ``r`` reads ``lhs[r // rows_per_lhs_row]`` (the MoE's gate/up reads each token's
    hidden state once for its ``k`` rows: no repeated copy), and a row whose expert is outside ``0 .. G-1`` is
    written zero by its own program (no zeroed output to start from). Out ``[m + 1, n]``, ``m =
    len(row_expert)``: row m is scratch (a masked lane's store names it: Pallas' interpret mode writes masked
    lanes back, so they must not name a real row); ``lhs`` may carry it too (``lhs[: m // rows_per_lhs_row]``
    is read), so the down product takes the gate/up product as it comes. ``launch``: ``rows_launch``'s bounds
    (A/B runs: ``benchmarks/moe_rows_launch.py``).

    ``shared``: a shared MLP's weights, ``S`` experts of ``rhs``'s size side by side — gated ``[k, 2 * S * n]``
    (its gate columns, then its up columns), plain ``[S * k, n]`` — computed in the same launch as ``S``
    experts ``G .. G+S-1`` that every token selects. ``row_expert`` is then the routed ids ``[T, r]`` and the
    ``m = T * (r + S)`` rows are token-major: a token's r routed rows, then its S shared ones (none when its
    first routed id is outside ``0 .. G-1``: a padding token); the shared rows' sum is the MLP's output."""
    num_groups, k, n = rhs.shape[0], lhs.shape[1], _out_width(rhs, activation)
    routed, extra = 1, 0
    if shared is not None:
        if row_expert.ndim != 2:
            raise ValueError(f"with shared experts the row experts are [tokens, k], not {row_expert.shape}")
        routed, extra = row_expert.shape[1], _shared_experts(shared.shape, k, n, activation is not None)
    m = row_expert.shape[0] * (routed + extra) if shared is not None else row_expert.shape[0]
    if lhs.shape[0] * rows_per_lhs_row < m:
        raise ValueError(f"{lhs.shape[0]} lhs rows x {rows_per_lhs_row} < {m} row experts")
    block_m = _rows_block(max_rows_per_expert)
    block_n, block_k, warps, stages = rows_launch(k, n, launch, gated=activation is not None, block_m=block_m,
                                                  itemsize=jnp.dtype(lhs.dtype).itemsize)
    return pl.pallas_call(
        functools.partial(_rows_fused_kernel, m=m, mp=max(16, 1 << (m - 1).bit_length()), k=k, groups=num_groups,
                          routed=routed, shared=extra, block_m=block_m, block_k=block_k,
                          block_n=block_n, per_lhs=rows_per_lhs_row, activation=activation),
        grid=(m, n // block_n),
        out_shape=jax.ShapeDtypeStruct((m + 1, n), lhs.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret or jax.default_backend() != "gpu", name="moe_expert_rows",
    )(row_expert.reshape(-1).astype(jnp.int32), lhs, rhs.reshape(num_groups * k, -1),
      *(() if shared is None else (shared,)))


def _shared_experts(shape: tuple, k: int, n: int, gated: bool) -> int:
    """How many experts of a ``[k, n]`` product (gated: ``[k, 2n]``) the shared weights of ``shape`` hold."""
    size = shape[1] // (2 * n) if gated else shape[0] // k
    if size < 1 or tuple(shape) != ((k, 2 * size * n) if gated else (size * k, n)):
        raise ValueError(f"shared expert weights {tuple(shape)} are not experts of [{k}, {2 * n if gated else n}] "
                         f"side by side")
    return size


def _row_experts(expert_ref, idx, *, m, groups, routed, shared):
    """The expert of each row ``idx`` (-1 past row m): ``row_expert[idx]``, or with ``shared`` experts the
    token-major rows' (see ``expert_rows_matmul_fused``), an unowned routed id made -1."""
    inside = idx < m
    if not shared:
        return plgpu.load(expert_ref.at[jnp.minimum(idx, m - 1)], mask=inside, other=-1)
    per = routed + shared
    tok, slot = idx // per, idx % per

    def owned(i):
        e = plgpu.load(expert_ref.at[jnp.minimum(i, m // per * routed - 1)], mask=inside, other=-1)
        return jnp.where((e >= 0) & (e < groups), e, -1)

    own = owned(tok * routed + jnp.minimum(slot, routed - 1))
    return jnp.where(slot < routed, own, jnp.where(owned(tok * routed) >= 0, groups + slot - routed, -1))


def _rows_fused_kernel(expert_ref, lhs_ref, rhs_ref, *refs, m, mp, k, groups, routed, shared, block_m, block_k,
                       block_n, per_lhs, activation):
    """Program (t, j): if row t is the first row of its expert, that expert's rows (in order, at most block_m)
    times its weights' columns block j (a shared expert's from ``shared_ref``); if row t has no expert here,
    zeros in its row; otherwise nothing."""
    shared_ref, out_ref = refs if shared else (None, refs[0])
    t, j = pl.program_id(0), pl.program_id(1)
    idx = lax.iota(jnp.int32, mp)
    ids = _row_experts(expert_ref, idx, m=m, groups=groups, routed=routed, shared=shared)           # [mp]
    e = jnp.sum(jnp.where(idx == t, ids, 0)) if shared else expert_ref[t]
    mine = (e >= 0) & (e < groups + shared)
    same = (ids == e) & (idx < m)
    first = jnp.sum(jnp.where(same & (idx < t), 1, 0)) == 0
    r = lax.iota(jnp.int32, block_m)
    cols = j * block_n + lax.iota(jnp.int32, block_n)
    n = out_ref.shape[1]

    def tile(weights_ref, row0, col0, half):
        # the expert's rows in order, each the first same row after the last (block_m reductions over [mp]:
        # no [mp, mp] rank matrix, whose registers a bucket of 16 tokens, k = 8 would spill)
        rows, last = jnp.full((block_m,), m, jnp.int32), t
        for slot in range(block_m):
            rows = jnp.where(r == slot, last, rows)
            last = jnp.min(jnp.where(same & (idx > last), idx, m))
        live = rows < m                                                                              # [block_m]
        out = _tile_product(lhs_ref, weights_ref, out_ref, jnp.where(live, rows // per_lhs, 0), live, row0,
                            col0 + cols, k=k, block_k=block_k, activation=activation, half=half)
        plgpu.store(out_ref.at[rows[:, None], cols[None, :]], out,
                    mask=jnp.broadcast_to(live[:, None], (block_m, block_n)))

    @pl.when(mine & first & (e < groups))
    def _():
        tile(rhs_ref, e * k, 0, n)

    if shared:      # shared expert s: columns s * n of each half (gated), else rows s * k
        @pl.when(mine & first & (e >= groups))
        def _():
            s = e - groups
            if activation is None:
                tile(shared_ref, s * k, 0, n)
            else:
                tile(shared_ref, 0, s * n, shared * n)

    @pl.when(jnp.logical_not(mine))
    def _():
        plgpu.store(out_ref.at[jnp.where(r == 0, t, m)[:, None], cols[None, :]],
                    jnp.zeros((block_m, block_n), out_ref.dtype),
                    mask=jnp.broadcast_to((r == 0)[:, None], (block_m, block_n)))


def _tiles_matmul(lhs, rhs, plan, *, block_m: int, block_k: int, block_n: int, gathered: bool,
                  activation: Callable | None, interpret: bool) -> jax.Array:
    """The kernel over a tile plan ``(group, first row or row indices, num_rows)``: rows no tile covers come
    out zero."""
    m, k = lhs.shape
    num_groups, n = rhs.shape[0], _out_width(rhs, activation)
    group, row0, rows = plan
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, m=m, k=k, block_m=block_m, block_k=block_k, block_n=block_n,
                          gathered=gathered, activation=activation),
        grid=(group.shape[0], n // block_n),
        out_shape=jax.ShapeDtypeStruct((m + 1, n), lhs.dtype),
        input_output_aliases={5: 0},          # zeros: rows no tile covers stay zero
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret, name="moe_grouped_matmul",
    )(group, row0, rows, lhs, rhs.reshape(num_groups * k, -1), jnp.zeros((m + 1, n), lhs.dtype))
    return out[:m]
