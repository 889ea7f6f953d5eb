"""AWQ, GPTQ and compressed-tensors int4 tensors → one layout (``Int4Parts``), in numpy at load.

Each reader returns a module's weight as unsigned 4-bit values ``q [K, N]`` in the model's ``[in, out]``
layout, with per-group ``scales [K/G, N]`` (the checkpoint's float dtype, unchanged) and integer ``zeros
[K/G, N]`` such that ``w = (q - zeros) * scales``, and ``perm`` when GPTQ's act-order stores the input
channels out of group order. GGUF's types (``gguf_formats``) add a float ``mins [K/G, N]`` per group, and
its k-quants two-level scales: ``scales`` and ``mins`` as small integers times per-super-block
``super_scales`` / ``super_mins [K/S, N]``, so ``w = (q - zeros) * scales * super_scales - mins * super_mins``
(each factor broadcast over its rows); its 5- to 8-bit types: ``q`` up to 255 less a static ``offset``, its
low nibble packed as usual and the bits above (``high_bits`` of them) in a second plane. ``combine`` then
applies the weight plan's build (stack gate and up, slice a fused projection) and ``pack`` packs ``q`` along K
into ``kernels/int4_matmul_pallas.py``'s layout.

The formats' packing rules, as their quantizers write them:
* AWQ (GEMM): ``qweight [K, N/8]`` int32 packs 8 output columns per word in the order 0, 2, 4, 6, 1, 3, 5, 7
  (nibble ``i`` holds column ``ORDER[i]``); ``qzeros [K/G, N/8]`` the same way; ``scales [K/G, N]``.
* GPTQ (v1): ``qweight [K/8, N]`` packs 8 input rows per word (nibble ``j`` of row ``r`` is row ``8r + j``);
  ``qzeros [K/G, N/8]`` packs columns in natural order and stores ``zero - 1`` (read back as ``stored + 1``,
  modulo 16); ``g_idx [K]`` the group of each input row: with ``desc_act`` the rows of a group are scattered,
  and sorting the rows by group (``perm``) makes them contiguous again, so the step gathers ``x[:, perm]``.
* compressed-tensors ``pack-quantized``: ``weight_packed [N, K/8]`` packs 8 input columns per word (natural
  order) of the signed values offset by 8; ``weight_scale [N, K/G]``; asymmetric ``weight_zero_point
  [N/8, K/G]`` packs 8 output rows per word, also offset by 8; ``weight_shape`` = ``[N, K]``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxserve.errors import ModelLoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i of an AWQ word holds column AWQ_ORDER[i]
PACK = 8


@dataclasses.dataclass
class Int4Parts:
    q: np.ndarray                  # uint8 [K, *out], 0..15 (up to 0..255 with ``high_bits``)
    scales: np.ndarray             # [K/G, *out] float
    zeros: np.ndarray | None       # int8 [K/G, *out], 0..15; None: 0 (GGUF's types with mins)
    perm: np.ndarray | None        # int32 [K] or None
    group_size: int
    mins: np.ndarray | None = None           # [K/G, *out]: subtracted after the scale (GGUF Q4_1, Q4_K)
    super_scales: np.ndarray | None = None   # [K/S, *out]: a factor of S/G groups' scales (GGUF k-quants)
    super_mins: np.ndarray | None = None     # [K/S, *out]: the same for their mins
    offset: int = 0                          # subtracted from every q (the zero point of GGUF's Q5-Q8 types)
    high_bits: int = 0                       # bits of q above the low four (1, 2 or 4: GGUF's Q5, Q6_K, Q8_0)

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-output-column arrays (``[in-ish, *out]``), by field name: what a build stacks or slices."""
        names = ("q", "scales", "zeros", "mins", "super_scales", "super_mins")
        return {f: getattr(self, f) for f in names if getattr(self, f) is not None}

    def with_arrays(self, fn: Callable[..., np.ndarray], *others: "Int4Parts") -> "Int4Parts":
        """These parts with ``fn(a, *the same array of others)`` for each per-column array."""
        return dataclasses.replace(self, **{f: fn(a, *(o.arrays()[f] for o in others))
                                            for f, a in self.arrays().items()})


def _unpack_last(packed: np.ndarray, order=tuple(range(PACK))) -> np.ndarray:
    """int32 ``[..., C]`` → uint8 ``[..., 8C]``: column ``8c + order[i]`` from nibble ``i`` of word ``c``."""
    u = packed.view(np.uint32)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1], PACK), np.uint8)
    for i, col in enumerate(order):
        out[..., col] = (u >> np.uint32(4 * i)) & np.uint32(15)
    return out.reshape(packed.shape[:-1] + (packed.shape[-1] * PACK,))


def _unpack_first(packed: np.ndarray) -> np.ndarray:
    """int32 ``[R, ...]`` → uint8 ``[8R, ...]``: row ``8r + j`` from nibble ``j`` of row ``r``."""
    return np.moveaxis(_unpack_last(np.moveaxis(packed, 0, -1)), -1, 0)


def pack(q: np.ndarray, bits: int = 4) -> np.ndarray:
    """uint8 ``[K, ...]`` (0..15) → int32 ``[K/8, ...]``, nibble ``j`` of row ``r`` = row ``8r + j``; with
    ``bits`` (1, 2, 4) per value, ``32 / bits`` rows to a word the same way."""
    k, per = q.shape[0], 32 // bits
    if k % per:
        raise ModelLoadError(f"int4 weight with {k} input rows (not a multiple of {per})")
    planes = q.reshape((k // per, per) + q.shape[1:]).astype(np.uint32)
    out = np.zeros((k // per,) + q.shape[1:], np.uint32)
    for j in range(per):
        out |= planes[:, j] << np.uint32(bits * j)
    return out.view(np.int32)


def _check(cond: bool, prefix: str, what: str) -> None:
    if not cond:
        raise ModelLoadError(f"{prefix}: {what}")


def _group(group_size: int, k: int, prefix: str) -> int:
    g = k if group_size == -1 else group_size
    _check(k % g == 0, prefix, f"{k} input features are not a multiple of the group size {g}")
    return g


def read_awq(get: Callable[[str], np.ndarray], prefix: str, group_size: int) -> Int4Parts:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    q = _unpack_last(qweight, AWQ_ORDER)
    k, n = q.shape
    g = _group(group_size, k, prefix)
    _check(scales.shape == (k // g, n), prefix, f"scales {scales.shape} do not fit qweight {qweight.shape} "
                                               f"with group_size {g}")
    zeros = _unpack_last(qzeros, AWQ_ORDER).astype(np.int8)
    _check(zeros.shape == scales.shape, prefix, f"qzeros {qzeros.shape} do not fit scales {scales.shape}")
    return Int4Parts(q, np.asarray(scales), zeros, None, g)


def read_gptq(get: Callable[[str], np.ndarray], prefix: str, group_size: int, has: Callable[[str], bool]
              ) -> Int4Parts:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    q = _unpack_first(qweight)
    k, n = q.shape
    g = _group(group_size, k, prefix)
    _check(scales.shape == (k // g, n), prefix, f"scales {scales.shape} do not fit qweight {qweight.shape} "
                                               f"with group_size {g}")
    zeros = ((_unpack_last(qzeros).astype(np.int16) + 1) & 15).astype(np.int8)      # v1: stored zero - 1
    _check(zeros.shape == scales.shape, prefix, f"qzeros {qzeros.shape} do not fit scales {scales.shape}")
    perm = None
    if has(f"{prefix}.g_idx"):
        g_idx = np.asarray(get(f"{prefix}.g_idx")).astype(np.int64)
        _check(g_idx.shape == (k,), prefix, f"g_idx {g_idx.shape} does not fit {k} input features")
        if not np.array_equal(g_idx, np.arange(k) // g):
            perm = np.argsort(g_idx, kind="stable")
            _check(np.array_equal(g_idx[perm], np.arange(k) // g), prefix,
                   f"g_idx does not give every group exactly {g} input features")
            q, perm = q[perm], perm.astype(np.int32)
    return Int4Parts(q, np.asarray(scales), zeros, perm, g)


def read_compressed_tensors(get: Callable[[str], np.ndarray], prefix: str, group_size: int, symmetric: bool,
                            has: Callable[[str], bool]) -> Int4Parts:
    packed, scales = get(f"{prefix}.weight_packed"), np.asarray(get(f"{prefix}.weight_scale"))
    q = _unpack_last(packed)                                         # [N, K]
    if has(f"{prefix}.weight_shape"):
        n, k = (int(v) for v in np.asarray(get(f"{prefix}.weight_shape")))
        _check(q.shape[0] == n and q.shape[1] >= k, prefix, f"weight_packed {packed.shape} does not fit "
                                                             f"weight_shape [{n}, {k}]")
        q = q[:, :k]
    n, k = q.shape
    g = _group(group_size, k, prefix)
    _check(scales.shape == (n, k // g), prefix, f"weight_scale {scales.shape} does not fit [{n}, {k // g}]")
    if symmetric or not has(f"{prefix}.weight_zero_point"):
        zeros = np.full((k // g, n), 8, np.int8)
    else:
        zp = _unpack_first(get(f"{prefix}.weight_zero_point"))[:n]   # [N, K/G], offset by 8 like the weights
        _check(zp.shape == scales.shape, prefix, f"weight_zero_point does not fit weight_scale {scales.shape}")
        zeros = np.ascontiguousarray(zp.T).astype(np.int8)
    return Int4Parts(np.ascontiguousarray(q.T), np.ascontiguousarray(scales.T), zeros, None, g)


def _same_form(parts: list[Int4Parts], name: str) -> None:
    """The modules of one fused weight must share their groups, act-order permutation and storage form."""
    first = parts[0]
    if any(p.group_size != first.group_size for p in parts):
        raise ModelLoadError(f"{name}: its modules have different group sizes")
    if any((p.perm is None) != (first.perm is None) or (p.perm is not None and not np.array_equal(p.perm, first.perm))
           for p in parts):
        raise ModelLoadError(f"{name}: its modules have different act-order permutations (g_idx); their fused "
                             f"projection needs one")
    forms = [(p.high_bits, p.offset, {f: a.shape[0] for f, a in p.arrays().items()}) for p in parts]
    if any(f != forms[0] for f in forms):
        raise ModelLoadError(f"{name}: its modules are stored in different int4 forms")


def combine(parts: list[Int4Parts], kind, name: str) -> Int4Parts:
    """One weight from its modules' parts by the weight plan's build ``kind`` (checkpoint_names)."""
    if kind == "t":
        return parts[0]
    if kind == "stack_t":           # gate and up
        _same_form(parts, name)
        return parts[0].with_arrays(lambda a, b: np.stack([a, b], axis=1), parts[1])
    if kind == "cat_t":             # projections of one input side by side on the outputs (a fused qkv)
        _same_form(parts, name)
        return parts[0].with_arrays(lambda *arrays: np.concatenate(arrays, axis=1), *parts[1:])
    p = parts[0]
    if isinstance(kind, tuple) and kind[0] == "rows_t":
        cols = slice(kind[1], kind[2])
        return p.with_arrays(lambda a: a[:, cols])
    if kind == "fused_gate_up_t":
        return p.with_arrays(lambda a: a.reshape(a.shape[0], 2, a.shape[1] // 2))
    raise ModelLoadError(f"{name}: build {kind!r} has no int4 form")


def group_factor(a: np.ndarray, super_factor: np.ndarray | None) -> np.ndarray:
    """Per-group ``scales`` (or ``mins``) as float32, times their super-block factor when there is one (exact:
    a 6-bit integer times a float16 fits float32's mantissa)."""
    a = a.astype(np.float32)
    if super_factor is None:
        return a
    return a * np.repeat(super_factor.astype(np.float32), a.shape[0] // super_factor.shape[0], axis=0)


def dequantize(parts: Int4Parts) -> np.ndarray:
    """The float32 weight ``[K, *out]`` the parts stand for (rows in ``perm`` order when there is one):
    ``(q - offset - zeros) * scales - mins``, the scales and mins times their super-block factors."""
    g = parts.group_size
    s = np.repeat(group_factor(parts.scales, parts.super_scales), g, axis=0)
    q = parts.q.astype(np.float32) - np.float32(parts.offset)
    w = (q if parts.zeros is None else q - np.repeat(parts.zeros.astype(np.float32), g, axis=0)) * s
    if parts.mins is not None:
        w -= np.repeat(group_factor(parts.mins, parts.super_mins), g, axis=0)
    return w
