"""The routed experts of one MoE layer at decode sizes in two Pallas Triton kernels, and its jnp reference.

``fused_moe(h [T, hidden], ids [T, k], weights [T, k], gate_up [E, hidden, 2, inter], down [E, inter, hidden],
activation)`` -> ``[T, hidden]`` float32: for each token the sum over its k experts of
``weight * down(activation(h @ gate) * (h @ up))``. An id outside ``0 .. E-1`` (a padding token, an expert
another device owns) contributes nothing and costs nothing. For ``T <= MAX_TOKENS``.

NOTE the decode shape: a decode step's tokens fit in one 16-row tile, so an expert's "rows" are simply all
the step's tokens, masked to those routed to it: no sort, no group sizes, no tile plan, no gather of rows
and no scatter back. Each of the ``T * k`` (token, slot) assignments is a candidate program; the program of
an expert's first assignment (the kernel compares the id with the earlier ones) computes that expert, the
others exit at once, so every selected expert's weights are read exactly once.

- ``_gate_up_kernel``, grid ``(T * k, inter / block_i)``: one expert's ``block_i`` intermediate columns of
  gate and up for all token rows, the activation, written as ``act [T * k, 16, inter]`` (the slot's row
  block; a dead slot's block is never written and never read). Its first column block also writes what the
  down kernel needs: the computing slots compacted in slot order (their count, experts and slots: each
  program counts the computing slots before its own) and each token's routing weight for the slot's
  expert (zero for tokens not routed to it).
- ``_down_kernel``, grid ``(hidden / block_h, splits)``: ``block_h`` output columns over one ``1 / splits``
  share of ``inter``, one flat loop over (computing slot, k-step) (one loop, so Triton pipelines the loads
  across experts; a padding token's slots cost no iteration); each step's product times each token's
  weight is summed: the weighted combine happens in the kernel. The ``splits`` partial sums come out
  float32 and the caller's sum over them fuses with the residual add.

Numerics follow the unfused layer: products accumulate in float32, gate and up are rounded to the weight
dtype before the activation, the activation's output is in the weight dtype; the down product stays
float32 until the combine. On CPU the kernels run in interpret mode (the tests).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_TOKENS = 16          # one tile of token rows (Triton's smallest dot is 16 rows)
TILE = 16


def fused_moe_reference(h, ids, weights, gate_up, down, activation: Callable) -> jax.Array:
    """Every expert on every token, masked by the routing: the obvious definition (float32 result)."""
    e = gate_up.shape[0]
    gu = jnp.einsum("th,ehci->etci", h, gate_up, preferred_element_type=jnp.float32).astype(h.dtype)
    act = (activation(gu[:, :, 0].astype(jnp.float32)).astype(h.dtype) * gu[:, :, 1]).astype(h.dtype)
    y = jnp.einsum("eti,eih->eth", act, down, preferred_element_type=jnp.float32)             # [E, T, hidden]
    w = jnp.sum(jnp.where(ids[None] == jnp.arange(e)[:, None, None], weights[None].astype(jnp.float32), 0),
                axis=2)                                                                        # [E, T]
    return jnp.einsum("et,eth->th", w, y)


def _block(size: int, largest: int) -> int:
    """The largest power of two <= ``largest`` and >= 16 dividing ``size``."""
    b = 1 << (largest.bit_length() - 1)
    while b >= 16:
        if size % b == 0:
            return b
        b //= 2
    raise ValueError(f"fused MoE: dimension {size} is not a multiple of 16")


def supports(tokens: int, hidden: int, inter: int) -> bool:
    """Whether the kernels take this shape (token count and 16-multiple widths)."""
    return tokens <= MAX_TOKENS and hidden % 16 == 0 and inter % 16 == 0


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _slot_ids(ids_ref, num_slots: int, n: int):
    """The ``num_slots`` (a power of two) assignment ids, -1 past the ``n`` real ones."""
    j = lax.iota(jnp.int32, num_slots)
    return plgpu.load(ids_ref.at[jnp.minimum(j, n - 1)], mask=j < n, other=-1)


def _live(ids_ref, j, num_slots: int, n: int, num_experts: int):
    """``(expert, whether slot j computes it)``: a local id whose first assignment slot ``j`` is."""
    e = ids_ref[jnp.minimum(j, n - 1)]
    earlier = jnp.sum(((_slot_ids(ids_ref, num_slots, n) == e) & (lax.iota(jnp.int32, num_slots) < j))
                      .astype(jnp.int32))
    return e, (j < n) & (e >= 0) & (e < num_experts) & (earlier == 0)


def _first_assignments(ids_ref, num_slots: int, n: int, num_experts: int):
    """``[num_slots]`` bool: slot i holds a local expert id no earlier slot holds (the slots that compute)."""
    ids = _slot_ids(ids_ref, num_slots, n)
    i = lax.iota(jnp.int32, num_slots)
    earlier_same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    return (ids >= 0) & (ids < num_experts) & (jnp.sum(earlier_same.astype(jnp.int32), axis=1) == 0)


def _gate_up_kernel(ids_ref, wts_ref, h_ref, gu_ref, act_ref, live_count_ref, live_expert_ref, live_slot_ref,
                    slot_w_ref, *, tokens, top_k, num_slots, num_experts, hidden, inter, block_k, block_i,
                    activation):
    j, nb = pl.program_id(0), pl.program_id(1)
    n = ids_ref.shape[0]
    e, live = _live(ids_ref, j, num_slots, n, num_experts)
    rows = lax.iota(jnp.int32, TILE)

    @pl.when(nb == 0)
    def _():    # what the down kernel reads: the computing slots in order, their experts, the routing weights
        first = _first_assignments(ids_ref, num_slots, n, num_experts).astype(jnp.int32)
        rank = jnp.sum(jnp.where(lax.iota(jnp.int32, num_slots) < j, first, 0))

        @pl.when(j == 0)
        def _():
            live_count_ref[0] = jnp.sum(first)

        @pl.when(live)
        def _():
            live_expert_ref[rank] = e
            live_slot_ref[rank] = j
            kp = _pow2(top_k)
            slot = (jnp.minimum(rows, tokens - 1)[:, None] * top_k
                    + jnp.minimum(lax.iota(jnp.int32, kp), top_k - 1)[None, :])
            mine = (rows < tokens)[:, None] & (lax.iota(jnp.int32, kp) < top_k)[None, :]
            tok_ids = plgpu.load(ids_ref.at[slot], mask=mine, other=-1)                            # [16, kp]
            tok_wts = plgpu.load(wts_ref.at[slot], mask=mine, other=0).astype(jnp.float32)
            plgpu.store(slot_w_ref.at[j * TILE + rows], jnp.sum(jnp.where(tok_ids == e, tok_wts, 0.0), axis=1))

    @pl.when(live)
    def _():
        cols = nb * block_i + lax.iota(jnp.int32, block_i)
        w_row0 = e * hidden                                   # gu_ref: [E * hidden, 2 * inter]

        def step(kb, acc):
            ks = kb * block_k + lax.iota(jnp.int32, block_k)
            x = plgpu.load(h_ref.at[jnp.minimum(rows, tokens - 1)[:, None], ks[None, :]],
                           mask=(rows < tokens)[:, None] & (ks >= 0)[None, :], other=0)          # [16, bk]
            wg = plgpu.load(gu_ref.at[(w_row0 + ks)[:, None], cols[None, :]])                # [bk, bi]
            wu = plgpu.load(gu_ref.at[(w_row0 + ks)[:, None], (inter + cols)[None, :]])
            return (acc[0] + plgpu.dot(x, wg, allow_tf32=False), acc[1] + plgpu.dot(x, wu, allow_tf32=False))

        zeros = jnp.zeros((TILE, block_i), jnp.float32)
        g, u = lax.fori_loop(0, hidden // block_k, step, (zeros, zeros))
        dt = act_ref.dtype
        a = activation(g.astype(dt).astype(jnp.float32)).astype(dt) * u.astype(dt)
        plgpu.store(act_ref.at[(j * TILE + rows)[:, None], cols[None, :]], a.astype(dt))


def _down_kernel(live_count_ref, live_expert_ref, live_slot_ref, slot_w_ref, act_ref, down_ref, out_ref, *, inter,
                 block_k, block_h, chunk):
    hb, sp = pl.program_id(0), pl.program_id(1)
    rows = lax.iota(jnp.int32, TILE)
    cols = hb * block_h + lax.iota(jnp.int32, block_h)
    k_steps = chunk // block_k

    def step(i, acc):
        r, kb = lax.div(i, jnp.int32(k_steps)), lax.rem(i, jnp.int32(k_steps))    # i >= 0: no floor fix-up
        e, j = live_expert_ref[r], live_slot_ref[r]
        w_tok = plgpu.load(slot_w_ref.at[j * TILE + rows])
        ks = sp * chunk + kb * block_k + lax.iota(jnp.int32, block_k)
        a = plgpu.load(act_ref.at[(j * TILE + rows)[:, None], ks[None, :]])
        w = plgpu.load(down_ref.at[(e * inter + ks)[:, None], cols[None, :]])
        prod = plgpu.dot(a, w, allow_tf32=False)
        # a token not routed to this expert has weight 0 and its row is never added (even if not finite)
        return acc + jnp.where((w_tok != 0)[:, None], w_tok[:, None] * prod, 0.0)

    # only the computing slots, compacted by the gate/up kernel: no iteration for a padding token's slots
    acc = lax.fori_loop(0, live_count_ref[0] * k_steps, step, jnp.zeros((TILE, block_h), jnp.float32))
    plgpu.store(out_ref.at[(sp * TILE + rows)[:, None], cols[None, :]], acc)


# per GPU program: gate/up's intermediate columns; down's output columns and its share of intermediate; gate/up's
# and down's rows per loop step; Triton's pipeline depth and warps (one compiler setting for both kernels)
GPU_BLOCKS = {"block_i": 32, "block_h": 64, "splits": 4, "block_k": 128, "down_block_k": 64, "num_stages": 3,
              "num_warps": 4}


# a block setting's short keys, as in "bi=32,dk=128,w=8" (moe_gemm's fused[...] rows, JAXSERVE_MOE_FUSED_BLOCKS)
BLOCK_KEYS = {"bi": "block_i", "bh": "block_h", "s": "splits", "bk": "block_k", "dk": "down_block_k",
              "st": "num_stages", "w": "num_warps"}


def parse_blocks(text: str) -> dict[str, int]:
    """The ``fused_moe`` block arguments of ``key=value,...`` (``BLOCK_KEYS``; a key left out stays at
    ``GPU_BLOCKS``), in ``GPU_BLOCKS``' order; ValueError names the part that is not one."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise ValueError("expected key=value,... (an empty part)")
    bad = [p for p in parts if "=" not in p]
    if bad:
        raise ValueError(f"{bad[0]!r} is not key=value")
    pairs = [tuple(q.strip() for q in p.split("=", 1)) for p in parts]
    unknown = [k for k, _ in pairs if k not in BLOCK_KEYS]
    if unknown:
        raise ValueError(f"unknown key {', '.join(unknown)} (keys: {', '.join(BLOCK_KEYS)})")
    seen = [k for k, _ in pairs]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"key {', '.join(twice)} given twice")
    for k, v in pairs:
        if not (v.isdigit() and int(v) > 0):
            raise ValueError(f"{k}={v!r}: every value a positive integer")
        if k == "w" and int(v) & (int(v) - 1):
            raise ValueError(f"w={v}: Triton's warps per program are a power of two")
    given = {BLOCK_KEYS[k]: int(v) for k, v in pairs}
    return {key: given[key] for key in GPU_BLOCKS if key in given}


def resolve_blocks(hidden: int, inter: int, *, interpret: bool = False, **given: int | None) -> dict[str, int]:
    """The block shapes ``fused_moe`` runs for these widths: each of ``GPU_BLOCKS``' keys from ``given`` (None:
    the default; interpreted, one block per expert), rounded down to a power of two dividing its dimension
    (``splits``: halved until ``inter`` splits into 16-multiples). Two settings that resolve alike run the
    same kernels (a tuning sweep skips the repeat)."""
    unknown = set(given) - set(GPU_BLOCKS)
    if unknown:
        raise TypeError(f"fused MoE blocks: unknown {', '.join(sorted(unknown))} (known: {', '.join(GPU_BLOCKS)})")
    want = {key: given.get(key) or default for key, default in GPU_BLOCKS.items()}
    if interpret:       # the interpreter runs programs one after another: as few as possible
        big = max(hidden, inter)
        want |= {key: given.get(key) or value for key, value in (("block_i", big), ("block_h", big), ("splits", 1))}
    splits = want["splits"]
    while splits > 1 and (inter % splits or (inter // splits) % 16):
        splits //= 2
    return {"block_i": _block(inter, want["block_i"]), "block_h": _block(hidden, want["block_h"]), "splits": splits,
            "block_k": _block(hidden, want["block_k"]), "down_block_k": _block(inter // splits, want["down_block_k"]),
            "num_stages": want["num_stages"], "num_warps": want["num_warps"]}


@functools.partial(jax.jit, static_argnames=("activation", "block_i", "block_h", "splits", "block_k", "down_block_k",
                                             "num_stages", "num_warps", "interpret"))
def fused_moe(h: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
              activation: Callable, *, block_i: int | None = None, block_h: int | None = None,
              splits: int | None = None, block_k: int | None = None, down_block_k: int | None = None,
              num_stages: int | None = None, num_warps: int | None = None,
              interpret: bool | None = None) -> jax.Array:
    """See the module docstring. ``block_i``: gate/up's intermediate columns per program; ``block_h`` and
    ``splits``: down's output columns per program and the share of ``inter`` each sums (``hidden / block_h
    * splits`` programs should fill the GPU); ``block_k`` / ``down_block_k``: gate/up's hidden rows and down's
    intermediate rows per loop step; ``num_stages`` / ``num_warps``: Triton's software pipeline depth and
    warps per program. Unset, ``GPU_BLOCKS`` (``resolve_blocks``). ``interpret``: None compiles the kernels
    on a GPU and interprets them elsewhere."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    t, k = ids.shape
    num_experts, hidden, _, inter = gate_up.shape
    assert supports(t, hidden, inter), (t, hidden, inter)
    b = resolve_blocks(hidden, inter, interpret=interpret, block_i=block_i, block_h=block_h, splits=splits,
                       block_k=block_k, down_block_k=down_block_k, num_stages=num_stages, num_warps=num_warps)
    block_i, block_h, splits, block_k = b["block_i"], b["block_h"], b["splits"], b["block_k"]
    chunk = inter // splits
    num_slots = _pow2(t * k)
    flat_ids, flat_wts = ids.astype(jnp.int32).reshape(-1), weights.reshape(-1)
    params = plgpu.CompilerParams(num_warps=b["num_warps"], num_stages=b["num_stages"])
    i32 = jnp.int32
    act, live_count, live_expert, live_slot, slot_w = pl.pallas_call(
        functools.partial(_gate_up_kernel, tokens=t, top_k=k, num_slots=num_slots, num_experts=num_experts,
                          hidden=hidden, inter=inter, block_k=block_k, block_i=block_i, activation=activation),
        grid=(num_slots, inter // block_i),
        out_shape=(jax.ShapeDtypeStruct((num_slots * TILE, inter), h.dtype), jax.ShapeDtypeStruct((1,), i32),
                   jax.ShapeDtypeStruct((num_slots,), i32), jax.ShapeDtypeStruct((num_slots,), i32),
                   jax.ShapeDtypeStruct((num_slots * TILE,), jnp.float32)),
        compiler_params=params, interpret=interpret, name="fused_moe_gate_up",
    )(flat_ids, flat_wts, h, gate_up.reshape(num_experts * hidden, 2 * inter))
    out = pl.pallas_call(
        functools.partial(_down_kernel, inter=inter, block_k=b["down_block_k"], block_h=block_h, chunk=chunk),
        grid=(hidden // block_h, splits),
        out_shape=jax.ShapeDtypeStruct((splits * TILE, hidden), jnp.float32),
        compiler_params=params, interpret=interpret, name="fused_moe_down",
    )(live_count, live_expert, live_slot, slot_w, act, down.reshape(num_experts * inter, hidden))
    return jnp.sum(out.reshape(splits, TILE, hidden), axis=0)[:t]
