"""W4A16 matmul with the dequantization fused into the kernel (Pallas, Triton lowering), and its jnp reference.

The weight layout (``jaxserve.quantization``'s ``Int4Weight``, which every int4 checkpoint format is repacked
into at load): ``packed`` int32 ``[K/8, N]`` whose nibble ``j`` (bits ``4j..4j+3``) of row ``r`` is the unsigned
4-bit value of input row ``8r + j``; ``scales`` ``[K/G, N]`` (float) and ``zeros`` ``[K/G, N]`` (int8, 0..15)
per group of ``G`` input rows: ``w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``. An optional
float ``mins [K/G, N]`` (GGUF's Q4_1 and Q4_K, stored without zero points: ``zeros`` None in the reference, a
zero array for the kernels) is subtracted after the scale: ``w[k, n] -= mins[k // G, n]``; the kernels leave
it out and ``group_mins_product`` gives ``x``'s group sums times ``mins`` to subtract afterwards. A weight
with a high plane (GGUF's 5- to 8-bit types: ``q = low + 16 high - offset``, ``high`` 1, 2 or 4 bits a value,
``unpack_bits``) runs as two products on this layout, the high plane widened to nibbles (``pack_int4``) with
``16 * scales`` and the zero point ``offset / 16``.

Why this layout: N is the contiguous axis, so a program's tile of ``[bk/8, bn]`` words is ``bk/8`` runs of
``4 bn`` bytes, each loaded as 16-byte vectors by consecutive threads (coalesced); packing along K keeps
tensor parallelism free to split K or N at any group boundary. Nibble plane ``j`` of a tile holds input rows
``j, j + 8, ...``, which meet the stride-8 elements ``j, j + 8, ...`` of ``x`` (a strided load of the small
activation): no interleaving of the weight in registers.

Two kernels; both walk K in steps of ``bk`` rows that never cross a group (one scale/zero row per step) and
split K over ``split_k`` programs when the output columns alone would not fill the GPU (decode shapes); the
partial sums are added by XLA.

* ``"fma"`` (one row: batch-1 decode): each program owns ``bn`` columns and keeps a float32 accumulator
  *as a 2-D tile* ``[bk/8, bn]``, multiply-adding the activation broadcast along the columns into it; the one
  reduction happens once, at the end. No tensor core, so no padding of ``M`` to 16. Launch it with
  ``bn = 128 * num_warps``: Triton then gives the ``[1, bn]`` scale / zero rows, the output row and the
  ``[bk/8, bn]`` weight tile one register layout (4 consecutive words per thread, a thread owning whole
  columns), so no tile changes layout through shared memory inside the loop (with 4 warps over 128
  columns the accumulator took the scale row's layout and every step paid a shared-memory round trip).
  More rows spill: each holds two ``[bk/8, 4]`` tiles per thread.
* ``"dot"`` (``M`` up to 64): the same dequantized planes, each a ``[16, bk/8] x [bk/8, bn]`` tensor-core dot
  (Triton's dot needs 16 rows of ``x``, padded, and a K of at least 16: ``bk >= 128``); its cost per weight
  does not grow with ``M``.

Dequantization costs two instructions per weight, neither a slow int-to-float conversion: a nibble masked in
place and OR-ed into the mantissa of 2^23 (``MAGIC``) is the float ``2^23 + q * 2^s`` exactly; subtracting
2^23 leaves ``q 2^s`` (the dot kernel subtracts 2^23 + z 2^s: ``(q - z) 2^s``, the zero point for free), and
the ``2^-s`` goes into the activation (exact: a power of two). Nibbles 0..4 sit in the 23 mantissa bits as
stored (``s = 4j``); 5..7 after one shift of the word by 20. The scale (and the fma kernel's zero point, as
``z sum_k x_k``) is applied once per step and column, not per weight.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .device_info import num_sms

PACK = 8          # int4 values per int32
MAGIC = 0x4B000000            # the float32 bits of 2^23
MAGIC_F = float(2 ** 23)
FMA_MAX_ROWS = 16             # the "fma" kernel unrolls its rows (correct for any; fast for one)
GEMV_MAX_ROWS = 8             # the "gemv" kernel: one multiply-add per weight and row, no spills up to 8 rows
DOT_MAX_ROWS = 64
METHODS = ("fma", "gemv", "dot")


def unpack_int4(packed: jax.Array) -> jax.Array:
    """``[K/8, ...]`` int32 → ``[K, ...]`` int32 values 0..15 (row ``8r + j`` from nibble ``j`` of row ``r``)."""
    return unpack_bits(packed, 4)


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """``[K bits/32, ...]`` int32 → ``[K, ...]`` int32 values: row ``(32/bits) r + j`` from bits
    ``bits j ..`` of row ``r`` (``bits`` 1, 2 or 4)."""
    per = 32 // bits
    shifts = (bits * jnp.arange(per, dtype=jnp.int32)).reshape((1, per) + (1,) * (packed.ndim - 1))
    q = lax.shift_right_logical(packed[:, None], shifts) & ((1 << bits) - 1)
    return q.reshape((packed.shape[0] * per,) + packed.shape[1:])


def pack_int4(q: jax.Array) -> jax.Array:
    """``unpack_int4``'s inverse: ``[K, ...]`` int32 values 0..15 → ``[K/8, ...]`` int32."""
    shifts = (4 * jnp.arange(PACK, dtype=jnp.int32)).reshape((1, PACK) + (1,) * (q.ndim - 1))
    planes = q.reshape((q.shape[0] // PACK, PACK) + q.shape[1:]) << shifts
    return jnp.sum(planes, axis=1, dtype=jnp.int32)       # disjoint bits: the sum is their OR


def dequantize_int4(packed: jax.Array, scales: jax.Array, zeros: jax.Array | None, group_size: int,
                    dtype=jnp.float32, mins: jax.Array | None = None, high: jax.Array | None = None,
                    offset: int = 0, high_bits: int = 4) -> jax.Array:
    """The float weight ``[K, ...]``: ``(q - zero) * scale - min`` in float32 (``zeros`` None: no zero point,
    ``mins`` None: no min), then cast to ``dtype``. ``high``: each value's bits above the low four, packed
    ``high_bits`` to a value (``q = low + 16 high - offset``: up to 8 bits, GGUF's Q5 to Q8 types)."""
    q = unpack_int4(packed).astype(jnp.float32)
    if high is not None:
        q = q + 16.0 * unpack_bits(high, high_bits).astype(jnp.float32) - float(offset)
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    if zeros is not None:
        q = q - jnp.repeat(zeros.astype(jnp.float32), group_size, axis=0)
    w = q * s
    if mins is not None:
        w = w - jnp.repeat(mins.astype(jnp.float32), group_size, axis=0)
    return w.astype(dtype)


def int4_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                          group_size: int, mins: jax.Array | None = None, high: jax.Array | None = None,
                          offset: int = 0, high_bits: int = 4) -> jax.Array:
    """``x [M, K] @ w [K, N]`` with ``w`` dequantized to ``x``'s dtype first; float32 accumulation."""
    w = dequantize_int4(packed, scales, zeros, group_size, x.dtype, mins, high, offset, high_bits)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def group_mins_product(x: jax.Array, mins: jax.Array, group_size: int) -> jax.Array:
    """``x [M, K]``'s sums over each group of ``group_size`` inputs times ``mins [K/G, N]``, float32 ``[M, N]``:
    what a weight's per-group mins take from ``x @ w`` (``sum_k x_k (q_k s - m) = s sum_k x_k q_k - m sum_k
    x_k`` within a group)."""
    sums = x.astype(jnp.float32).reshape(x.shape[0], -1, group_size).sum(-1)
    return jnp.dot(sums, mins.astype(jnp.float32), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch's options (``benchmarks/kernel_bench.py --tune`` sweeps them)."""
    method: str = "fma"
    block_n: int = 128
    block_k: int | None = None     # K rows per step (``gemv``: fewer rows, more columns per thread); None: ``block_k``
    split_k: int | None = None     # None: enough K splits to fill the GPU
    unroll: int = 1                # K steps whose loads are issued together (memory-level parallelism)
    num_warps: int = 4
    num_stages: int = 2


def block_k(group_size: int) -> int:
    """K rows per kernel step: the group, or 128-row slices of a larger group (per-channel: G = K)."""
    return 128 if group_size % 128 == 0 else group_size


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def step_rows(config: "Config", group_size: int) -> int:
    """K rows per kernel step of this launch: ``config.block_k`` when it divides the group, else ``block_k``."""
    bk = config.block_k
    if bk and config.method != "dot" and group_size % bk == 0 and _pow2(bk // PACK):
        return bk
    return block_k(group_size)


def supports(m: int, k: int, n: int, group_size: int, *, interpret: bool = False, method: str | None = None
             ) -> bool:
    """Whether ``int4_matmul`` runs this shape (else use the reference)."""
    method = method or default_config(m, k, n, group_size).method
    bk = block_k(group_size)
    if k % bk or not _pow2(bk // PACK) or _fit_block_n(n, 16) is None:
        return False
    if method == "fma":
        return m <= FMA_MAX_ROWS
    if method == "gemv":
        return m <= GEMV_MAX_ROWS
    return m <= DOT_MAX_ROWS and (interpret or bk // PACK >= 16)


def _fit_block_n(n: int, want: int) -> int | None:
    return next((b for b in (want, 256, 128, 64, 32, 16) if b <= want and n % b == 0), None)


# The fastest measured launch per (K, N, M, live rows): written by
# ``benchmarks/kernel_bench.py --only quant --tune --write-launches`` on the GPU it serves on
LAUNCHES_FILE = pathlib.Path(__file__).with_name("int4_launches.json")


def launch_key(k: int, n: int, m: int, live_one: bool = False) -> str:
    return f"{k}x{n} m={m}" + (" live=1" if live_one else "")


@functools.lru_cache(maxsize=1)
def tuned_launches() -> dict[str, Config]:
    """``LAUNCHES_FILE``'s entries (none when it is absent): ``{launch_key: Config}``."""
    if not LAUNCHES_FILE.exists():
        return {}
    entries = json.loads(LAUNCHES_FILE.read_text())["launches"]
    return {e["key"]: Config(**e["config"]) for e in entries}


def default_config(m: int, k: int, n: int, group_size: int, live_one: bool = False) -> Config:
    """The launch the engine uses: the measured best (``tuned_launches``) for this shape, else the launch
    chosen from the compiled code (``kernels/README.md``, the int4 section). ``live_one``: the step may have
    one real row (the engine passes the live row count; only the ``gemv`` launch uses it)."""
    tuned = tuned_launches()
    cfg = tuned.get(launch_key(k, n, m, live_one)) or tuned.get(launch_key(k, n, m))
    if cfg is not None:
        return cfg
    if m == 1:
        return Config(method="fma", block_n=128, num_warps=1, unroll=1)
    return Config(method="dot", block_n=128, num_warps=8, unroll=1, num_stages=3)


def _split_k(k_blocks: int, tiles: int, num_warps: int, unroll: int, min_steps: int = 1) -> int:
    """K splits for about 16 warps per SM (a decode launch is latency-bound below that), each split keeping at
    least ``unroll`` and ``min_steps`` K steps."""
    want = max(1, -(-16 * num_sms() // (tiles * num_warps)))
    return max(d for d in range(1, k_blocks + 1)
               if d == 1 or (k_blocks % d == 0 and d <= want and (k_blocks // d) % unroll == 0
                             and k_blocks // d >= min_steps))


# gemv splits keep a loop of this many K steps: with one step per program (q/o at 4096 x 4096 in 64-row
# steps) ptxas scheduled the straight-line code's loads first and spilled 1.4 KB per thread (SASS, sm_90)
GEMV_MIN_STEPS = 4


def _planes(p: jax.Array, z: jax.Array | None) -> list[tuple[jax.Array, float]]:
    """The 8 nibble planes of a packed int32 tile as float32 ``(q - z) * 2^s`` (exact: ``|q - z| < 16``; ``z``
    the step's zero-point row, None for 0), each with its ``2^-s``."""
    out = []
    hi = lax.shift_right_logical(p, jnp.int32(20))
    for j in range(PACK):
        src, s = (p, 4 * j) if j < 5 else (hi, 4 * (j - 5))
        bits = (src & jnp.int32(15 << s)) | jnp.int32(MAGIC)
        bias = MAGIC_F if z is None else MAGIC_F + z * float(2 ** s)
        out.append((lax.bitcast_convert_type(bits, jnp.float32) - bias, 2.0 ** -s))
    return out


def _exact_planes(p: jax.Array, bias: list[jax.Array]) -> list[jax.Array]:
    """The 8 nibble planes of a packed int32 tile as float32 ``q - z`` (exact), with no power of two left over:
    plane ``j``'s nibble, masked in place at bit ``s``, is OR-ed into the mantissa of ``2^(23 - s)``, whose
    mantissa unit is 1, so the float is ``2^(23 - s) + q``; ``bias[j]`` is ``2^(23 - s) + z``."""
    out = []
    hi = lax.shift_right_logical(p, jnp.int32(20))
    for j in range(PACK):
        src, s = (p, 4 * j) if j < 5 else (hi, 4 * (j - 5))
        bits = (src & jnp.int32(15 << s)) | jnp.int32((127 + 23 - s) << 23)
        out.append(lax.bitcast_convert_type(bits, jnp.float32) - bias[j])
    return out


def _plane_bias(z: jax.Array) -> list[jax.Array]:
    """``2^(23 - s) + z`` of each plane (``_exact_planes``) for the step's zero-point row ``z [1, bn]``."""
    return [z + float(2 ** (23 - (4 * j if j < 5 else 4 * (j - 5)))) for j in range(PACK)]


def _gemv_kernel(*refs, rows, bn, bk, group_size, k_steps, unroll, with_live):
    # Like "fma" in layout (a thread owns 4 whole columns per 128 the warp covers), but each packed row of
    # the step is its own [1, bn] load and each weight meets its activation as a scalar: one multiply-add per
    # weight and row into a [1, bn] accumulator, so a row costs bn / 32 / warps registers, not a [bk/8, bn]
    # tile (why "fma" spills at 2+ rows; a tt.reduce over the tile's K axis sums in a tree, 1.4 instructions
    # per product, and Triton hoists all 8 planes of the tile: spills at one row). The zero point sits in
    # the planes' bias (no activation sums) and the planes are exact (no 2^-s on the activations).
    # ``with_live``: the first operand holds how many leading rows of x are real (the rest are a token
    # bucket's padding); one live row runs a one-row loop and the padding rows' outputs are zeros.
    live_ref, (x_ref, p_ref, s_ref, z_ref, o_ref) = (refs[0], refs[1:]) if with_live else (None, refs)
    n, split = pl.program_id(0), pl.program_id(1)
    k = x_ref.shape[0] // rows
    cols = pl.ds(n * bn, bn)
    kp = bk // PACK

    def run(live: int) -> None:
        def block(k0, words, s, z, accs):
            bias = _plane_bias(z)
            ts = [None] * live
            for r, p in enumerate(words):
                for j, w in enumerate(_exact_planes(p, bias)):
                    for m in range(live):
                        xv = x_ref[m * k + k0 + PACK * r + j].astype(jnp.float32)
                        ts[m] = w * xv if ts[m] is None else ts[m] + w * xv
            return [accs[m] + s * ts[m] for m in range(live)]

        def step(i, accs):
            loads = []
            for u in range(unroll):
                k0 = (split * k_steps + i * unroll + u) * bk
                g = k0 // group_size
                words = [p_ref[pl.ds(k0 // PACK + r, 1), cols] for r in range(kp)]
                loads.append((k0, words, s_ref[pl.ds(g, 1), cols].astype(jnp.float32),
                              z_ref[pl.ds(g, 1), cols].astype(jnp.float32)))
            accs = list(accs)
            for ld in loads:
                accs = block(*ld, accs)
            return tuple(accs)

        zero = jnp.zeros((1, bn), jnp.float32)
        accs = lax.fori_loop(0, k_steps // unroll, step, tuple(zero for _ in range(live)))
        for m in range(rows):
            o_ref[pl.ds(split * rows + m, 1), cols] = (accs[m] if m < live else zero).astype(o_ref.dtype)

    if live_ref is None or rows == 1:
        run(rows)
    else:
        lax.cond(live_ref[0] <= 1, lambda: run(1), lambda: run(rows))


def _fma_kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, rows, bn, bk, group_size, k_steps, unroll):
    # x_ref is x flattened: plane j's activations are a 1-D strided load, expanded to the [bk/8, 1] column the
    # tile broadcasts (Triton keeps a 1-D vector in the tile's row layout: one load per row a thread owns)
    n, split = pl.program_id(0), pl.program_id(1)
    k = x_ref.shape[0] // rows
    cols = pl.ds(n * bn, bn)
    kp = bk // PACK

    def block(k0, p, s, z, accs):
        # plane-major: each dequantized plane serves every row, then dies. The zero point is applied per step
        # (``- z * sum x``), not folded into the planes: 8 per-plane zero rows cost this kernel registers
        ts, xs = [None] * rows, [None] * rows
        for j, (w, inv) in enumerate(_planes(p, None)):
            for m in range(rows):
                xj = x_ref[pl.ds(m * k + k0 + j, kp, stride=PACK)].astype(jnp.float32)[:, None]     # [kp, 1]
                ts[m] = w * (xj * inv) if j == 0 else ts[m] + w * (xj * inv)
                xs[m] = xj if j == 0 else xs[m] + xj
        return [accs[m] + s * (ts[m] - z * xs[m]) for m in range(rows)]

    def step(i, accs):
        loads = []
        for u in range(unroll):      # every load of the step first, then the math
            k0 = ((split * k_steps + i * unroll + u) * bk)
            g = k0 // group_size
            loads.append((k0, p_ref[pl.ds(k0 // PACK, kp), cols], s_ref[pl.ds(g, 1), cols].astype(jnp.float32),
                          z_ref[pl.ds(g, 1), cols].astype(jnp.float32)))
        accs = list(accs)
        for ld in loads:
            accs = block(*ld, accs)
        return tuple(accs)

    zero = jnp.zeros((kp, bn), jnp.float32)
    accs = lax.fori_loop(0, k_steps // unroll, step, tuple(zero for _ in range(rows)))
    for m in range(rows):
        o_ref[pl.ds(split * rows + m, 1), cols] = jnp.sum(accs[m], axis=0, keepdims=True).astype(o_ref.dtype)


def _dot_kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, bm, bn, bk, group_size, k_steps, unroll):
    # x is not padded to the row tile (no XLA pad before every call): rows past M read row M - 1 again (their
    # results are dropped), so every load stays inside x
    m, n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    x_rows = jnp.minimum(m * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0), x_ref.shape[0] - 1)
    x_cols = PACK * lax.broadcasted_iota(jnp.int32, (1, bk // PACK), 1)
    cols = pl.ds(n * bn, bn)
    out_rows = pl.ds(split * pl.num_programs(0) * bm + m * bm, bm)
    kp = bk // PACK

    def block(k0, p, s, z, acc):
        t = jnp.zeros((bm, bn), jnp.float32)
        for j, (w, inv) in enumerate(_planes(p, z)):
            xj = x_ref[x_rows, x_cols + (k0 + j)]
            t += jnp.dot((xj * inv).astype(x_ref.dtype), w.astype(x_ref.dtype), preferred_element_type=jnp.float32)
        return acc + s * t

    def step(i, acc):
        loads = []
        for u in range(unroll):
            k0 = (split * k_steps + i * unroll + u) * bk
            g = k0 // group_size
            loads.append((k0, p_ref[pl.ds(k0 // PACK, kp), cols], s_ref[pl.ds(g, 1), cols].astype(jnp.float32),
                          z_ref[pl.ds(g, 1), cols].astype(jnp.float32)))
        for ld in loads:
            acc = block(*ld, acc)
        return acc

    acc = lax.fori_loop(0, k_steps // unroll, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[out_rows, cols] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "config", "interpret"))
def int4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array, *, group_size: int,
                config: Config | None = None, interpret: bool = False, live_rows: jax.Array | None = None
                ) -> jax.Array:
    """``x [M, K] @ w [K, N]`` for the int4 weight ``(packed, scales, zeros)``; the result in ``x``'s dtype.

    ``live_rows`` (int32 scalar, the ``gemv`` launch only): x's rows from this one on are padding; the
    kernel computes one row when only one is live (batch-1 decode in a bucket of 4) and returns zeros for
    the padding rows."""
    m, k = x.shape
    n = packed.shape[1]
    cfg = config or default_config(m, k, n, group_size)
    bk = step_rows(cfg, group_size)
    bn = _fit_block_n(n, cfg.block_n)
    assert bn and k % bk == 0 and packed.shape[0] * PACK == k, (x.shape, packed.shape, group_size, cfg)
    k_blocks = k // bk
    if cfg.method in ("fma", "gemv"):
        bm, mp = m, m
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        mp = -(-m // bm) * bm
    tiles = (mp // bm) * (n // bn)
    unroll = cfg.unroll if k_blocks % cfg.unroll == 0 else 1
    split_k = cfg.split_k or _split_k(k_blocks, tiles, cfg.num_warps, unroll,
                                      GEMV_MIN_STEPS if cfg.method == "gemv" else 1)
    assert k_blocks % split_k == 0, (k_blocks, split_k)
    k_steps = k_blocks // split_k
    unroll = unroll if k_steps % unroll == 0 else 1
    out_dtype = x.dtype if split_k == 1 else jnp.float32
    common = dict(bn=bn, bk=bk, group_size=group_size, k_steps=k_steps, unroll=unroll)
    operands = ()
    if cfg.method == "gemv":
        with_live = live_rows is not None and m > 1
        kernel = functools.partial(_gemv_kernel, rows=m, with_live=with_live, **common)
        grid = (n // bn, split_k)
        xp = x.reshape(m * k)
        operands = (jnp.asarray(live_rows, jnp.int32).reshape(1),) if with_live else ()
    elif cfg.method == "fma":
        kernel = functools.partial(_fma_kernel, rows=m, **common)
        grid = (n // bn, split_k)
        xp = x.reshape(m * k)
    else:
        kernel = functools.partial(_dot_kernel, bm=bm, **common)
        grid = (mp // bm, n // bn, split_k)
        xp = x
    out = pl.pallas_call(
        kernel, grid=grid, out_shape=jax.ShapeDtypeStruct((split_k * mp, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret, name=f"int4_matmul_{cfg.method}")(*operands, xp, packed, scales, zeros)
    out = out if split_k == 1 else out.reshape(split_k, mp, n).sum(0).astype(x.dtype)
    return out[:m]
