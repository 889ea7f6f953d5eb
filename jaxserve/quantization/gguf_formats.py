"""GGUF (llama.cpp) quantized tensors → ``int4_formats.Int4Parts``, exactly, in numpy at load.

A GGUF linear weight is stored ``[N, K]`` (a row per output feature), each row a run of blocks along K. The
types kept quantized, with the values llama.cpp (and ``gguf.quants``) dequantize them to; ``q`` is the
unsigned integer a block stores per value, ``d`` / ``dmin`` / ``m`` float16, ``sc`` / ``mn`` small integers:

* up to 4 bits (``int4``):
  Q4_0 (32): ``w = d (q - 8)``: zero point 8, ``scales = d``.
  Q4_1 (32): ``w = d q + m``: no zero point (``zeros`` None), ``mins = -m``.
  Q4_K (256 = 8 x 32): ``w = d sc q - dmin mn``: ``scales = sc`` times ``super_scales = d``, ``mins = mn``
  times ``super_mins = dmin``. Q2_K (256 = 16 x 16): the same with 2-bit ``q`` and 4-bit ``sc``, ``mn``.
  Q3_K (256 = 16 x 16): ``w = d sc (q - 4)``, 3-bit ``q`` (its third bit the block's mask bit), signed 6-bit
  ``sc``: zero point 4.
* 5- to 8-bit, with a static ``offset`` and each value's bits above the low four in a second plane of
  ``high_bits`` bits per value (1 for the Q5 types, 2 for Q6_K, 4 for Q8_0):
  Q8_0 (32): ``w = d q_signed = d (q - 128)``.  Q5_0 (32): ``w = d (q - 16)``.  Q5_1 (32): ``w = d q + m``.
  Q5_K (256 = 8 x 32): as Q4_K with 5-bit ``q``.  Q6_K (256 = 16 x 16): ``w = d sc (q - 32)`` with signed
  8-bit ``sc`` per 16 values (groups of 16).

A 6- or 8-bit integer times a float16 fits float32's 24-bit mantissa, so every product above is exact, as
llama.cpp's own; the repacked weight dequantizes to the same float32 values bit for bit. Every other type
(the IQ types' codebooks, TQ*, MXFP4, ...) has no exact form here: the loader dequantizes it.

Block layouts (ggml-common.h): nibbles come in runs of bytes whose low nibbles are the run's first values and
high nibbles the next ones (runs of 16 bytes in Q4_0/Q4_1/Q5_0/Q5_1, 32 in Q4_K/Q5_K, 64 in Q6_K's low
bits); a 5-bit type's fifth bits are a bit plane (Q5_0/Q5_1: bit ``i`` of a uint32 for value ``i``; Q5_K:
bit ``j`` of byte ``l`` for value ``32 j + l``); Q6_K's top two bits four to a byte.
"""
from __future__ import annotations

import numpy as np

from jaxserve.errors import ModelLoadError

from .int4_formats import Int4Parts

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14   # GGML types
KEPT_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q5_K: "Q5_K", Q6_K: "Q6_K", Q8_0: "Q8_0"}
HIGH_BITS = {Q5_0: 1, Q5_1: 1, Q5_K: 1, Q6_K: 2, Q8_0: 4}      # bits of each value above the low four
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176,
                Q6_K: 210}
_BLOCK_VALUES = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q2_K: 256, Q3_K: 256, Q4_K: 256, Q5_K: 256,
                 Q6_K: 256}
_OFFSET = {Q4_0: 8, Q3_K: 4, Q5_0: 16, Q8_0: 128, Q6_K: 32}


def kept(tensor_type) -> bool:
    """Whether a GGUF tensor of ``tensor_type`` (``GGMLQuantizationType`` or its int) loads quantized."""
    return int(tensor_type) in KEPT_TYPES


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block ``[..., bytes]`` → ``[...]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """``[..., run c]`` bytes → ``[..., 2 run c]`` values: each run of bytes gives its low nibbles, then its high."""
    runs = qs.reshape(qs.shape[:-1] + (-1, 1, run))
    return np.concatenate([runs & 15, runs >> 4], axis=-2).reshape(qs.shape[:-1] + (-1,))


def _bit_planes(qh: np.ndarray, planes: int, bits: int) -> np.ndarray:
    """``[..., B]`` bytes → ``[..., planes * B]``: plane ``j`` (bits ``bits j ..``) of every byte, plane by plane."""
    shifts = (bits * np.arange(planes, dtype=np.uint8)).reshape(planes, 1)
    return ((qh[..., None, :] >> shifts) & ((1 << bits) - 1)).reshape(qh.shape[:-1] + (-1,))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's / Q5_K's 12 bytes per super-block ``[..., 12]`` → 6-bit ``(scales, mins)`` ``[..., 8]`` (ggml's
    ``get_scale_min_k4``)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _decode(b: np.ndarray, qtype: int) -> dict:
    """Blocks ``[N, K/B, bytes]`` → ``q`` ``[N, K/B, B]`` (uint8) and the type's scales, mins and factors."""
    if qtype in (Q4_0, Q4_1):
        start = 2 if qtype == Q4_0 else 4
        out = dict(q=_nibbles(b[..., start:], 16), scales=_f16(b, 0)[..., None])
        if qtype == Q4_1:
            out["mins"] = -_f16(b, 2)[..., None]
        return out
    if qtype in (Q5_0, Q5_1):
        start = 2 if qtype == Q5_0 else 4
        high = np.unpackbits(b[..., start:start + 4], axis=-1, bitorder="little")      # bit i: value i
        out = dict(q=_nibbles(b[..., start + 4:], 16) | (high << 4), scales=_f16(b, 0)[..., None])
        if qtype == Q5_1:
            out["mins"] = -_f16(b, 2)[..., None]
        return out
    if qtype == Q8_0:
        return dict(q=b[..., 2:] ^ np.uint8(128), scales=_f16(b, 0)[..., None])       # int8 + 128, as bits
    if qtype in (Q4_K, Q5_K):
        sc, mn = _k_scales(b[..., 4:16])
        if qtype == Q4_K:
            q = _nibbles(b[..., 16:], 32)
        else:
            q = _nibbles(b[..., 48:], 32) | (_bit_planes(b[..., 16:48], 8, 1) << 4)
        return dict(q=q, scales=sc, mins=mn, super_scales=_f16(b, 0)[..., None], super_mins=_f16(b, 2)[..., None])
    if qtype == Q2_K:           # 2-bit q four to a byte; 4-bit scale (low nibble) and min (high) per 16
        q = _bit_planes(b[..., 16:80].reshape(b.shape[:-1] + (2, 32)), 4, 2).reshape(b.shape[:-1] + (256,))
        return dict(q=q, scales=b[..., :16] & 15, mins=b[..., :16] >> 4, super_scales=_f16(b, 80)[..., None],
                    super_mins=_f16(b, 82)[..., None])
    if qtype == Q3_K:           # 2 low bits and a mask bit (ggml: value - 4 unless set); signed 6-bit scales per 16
        low = _bit_planes(b[..., 32:96].reshape(b.shape[:-1] + (2, 32)), 4, 2).reshape(b.shape[:-1] + (256,))
        sc = _nibbles(b[..., 96:104], 8) | (_bit_planes(b[..., 104:108], 4, 2) << 4)
        return dict(q=low | (_bit_planes(b[..., :32], 8, 1) << 2), scales=sc.astype(np.int8) - np.int8(32),
                    super_scales=_f16(b, 108)[..., None])
    assert qtype == Q6_K
    low = _nibbles(b[..., :128], 64)
    high = _bit_planes(b[..., 128:192].reshape(b.shape[:-1] + (2, 32)), 4, 2).reshape(low.shape)
    return dict(q=low | (high << 4), scales=b[..., 192:208].view(np.int8), super_scales=_f16(b, 208)[..., None])


def form(tensor_type) -> Int4Parts:
    """One zero block of ``tensor_type`` read as parts: which arrays and static fields its weights have (the
    weight tree's structure, known before any tensor is read)."""
    qtype = int(tensor_type)
    return read_gguf(np.zeros((1, _BLOCK_BYTES[qtype]), np.uint8), qtype, (1, _BLOCK_VALUES[qtype]), "form")


def read_gguf(rows: np.ndarray, tensor_type, shape: tuple[int, int], name: str) -> Int4Parts:
    """A GGUF tensor's rows (``GGUFTensor.data``: uint8 ``[N, K / block * block bytes]``) of a kept type →
    ``Int4Parts`` in the model's ``[K, N]`` layout; ``shape`` is HF's ``[N, K]``."""
    qtype = int(tensor_type)
    if qtype not in KEPT_TYPES:
        raise ModelLoadError(f"{name}: GGUF type {getattr(tensor_type, 'name', tensor_type)} has no int4 form")
    n, k = shape
    blocks = np.asarray(rows).view(np.uint8).reshape(n, k // _BLOCK_VALUES[qtype], _BLOCK_BYTES[qtype])
    parts = _decode(blocks, qtype)
    group = k // (parts["scales"].size // n)
    arrays = {f: np.ascontiguousarray(a.reshape(n, -1).T) for f, a in parts.items()}
    offset = _OFFSET.get(qtype, 0)
    high_bits = HIGH_BITS.get(qtype, 0)
    # a 4-bit type's zero point as the int4 layout's zeros; a wider one's as the static offset
    zeros = None if high_bits or not offset else np.full((k // group, n), offset, np.int8)
    return Int4Parts(zeros=zeros, perm=None, group_size=group, offset=offset if high_bits else 0,
                     high_bits=high_bits, **arrays)
