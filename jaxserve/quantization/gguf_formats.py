"""GGUF (llama.cpp) 4-bit tensors → ``int4_formats.Int4Parts``, exactly, in numpy at load.

A GGUF linear weight is stored ``[N, K]`` (a row per output feature), each row a run of blocks along K. The
types kept quantized, with the values llama.cpp (and ``gguf.quants``) dequantize them to:

* Q4_0, blocks of 32: ``d`` f16, 16 bytes of nibbles (low nibbles values 0..15, high 16..31);
  ``w = d (q - 8)``: int4 with zero point 8, ``scales = d``.
* Q4_1, blocks of 32: ``d``, ``m`` f16, the same nibbles; ``w = d q + m``: zero point 0, ``mins = -m``.
* Q4_K, super-blocks of 256: ``d``, ``dmin`` f16, 12 bytes of 6-bit scales and mins for its eight sub-blocks
  of 32, 128 bytes of nibbles (bytes ``32c..32c+31``: low nibbles sub-block ``2c``, high ``2c + 1``);
  ``w = d sc q - dmin m``: no zero point, ``scales = sc`` times ``super_scales = d``, ``mins = m`` times
  ``super_mins = dmin``. The products are exact in float32 (6 bits times 11), as llama.cpp's own.

Every other type (Q5_*, Q6_K, Q8_0, the IQ types, ...) has no exact int4 form: the loader dequantizes it.
"""
from __future__ import annotations

import numpy as np

from jaxserve.errors import ModelLoadError

from .int4_formats import Int4Parts

Q4_0, Q4_1, Q4_K = 2, 3, 12            # GGMLQuantizationType values
KEPT_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q4_K: "Q4_K"}
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q4_K: 144}
_BLOCK_VALUES = {Q4_0: 32, Q4_1: 32, Q4_K: 256}
GROUP = 32


def kept(tensor_type) -> bool:
    """Whether a GGUF tensor of ``tensor_type`` (``GGMLQuantizationType`` or its int) loads as int4."""
    return int(tensor_type) in KEPT_TYPES


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block ``[..., bytes]`` → ``[...]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """``[..., run c]`` bytes → ``[..., 2 run c]`` values: each run of bytes gives its low nibbles, then its high."""
    runs = qs.reshape(qs.shape[:-1] + (-1, 1, run))
    return np.concatenate([runs & 15, runs >> 4], axis=-2).reshape(qs.shape[:-1] + (-1,))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per super-block ``[..., 12]`` → 6-bit ``(scales, mins)`` ``[..., 8]`` (ggml's
    ``get_scale_min_k4``)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def read_gguf(rows: np.ndarray, tensor_type, shape: tuple[int, int], name: str) -> Int4Parts:
    """A GGUF tensor's rows (``GGUFTensor.data``: uint8 ``[N, K / block * block bytes]``) of a kept type →
    ``Int4Parts`` in the model's ``[K, N]`` layout; ``shape`` is HF's ``[N, K]``."""
    qtype = int(tensor_type)
    if qtype not in KEPT_TYPES:
        raise ModelLoadError(f"{name}: GGUF type {getattr(tensor_type, 'name', tensor_type)} has no int4 form")
    n, k = shape
    nbytes, nvals = _BLOCK_BYTES[qtype], _BLOCK_VALUES[qtype]
    blocks = np.asarray(rows).view(np.uint8).reshape(n, k // nvals, nbytes)
    super_scales = super_mins = mins = None
    if qtype == Q4_K:
        q = _nibbles(blocks[..., 16:], 32).reshape(n, k)
        sc, mn = _k_scales(blocks[..., 4:16])                       # [N, K/256, 8]
        scales, mins = sc.reshape(n, k // GROUP), mn.reshape(n, k // GROUP)
        super_scales, super_mins = _f16(blocks, 0), _f16(blocks, 2)
    else:
        start = 2 if qtype == Q4_0 else 4
        q = _nibbles(blocks[..., start:], 16).reshape(n, k)
        scales = _f16(blocks, 0)
        if qtype == Q4_1:
            mins = -_f16(blocks, 2)
    # Q4_1 and Q4_K have no zero point (their mins stand in for it): no zeros array
    zeros = np.full((k // GROUP, n), 8, np.int8) if qtype == Q4_0 else None

    def t(a):
        return None if a is None else np.ascontiguousarray(a.T)
    return Int4Parts(q=t(q), scales=t(scales), zeros=zeros, perm=None,
                     group_size=GROUP, mins=t(mins), super_scales=t(super_scales), super_mins=t(super_mins))
