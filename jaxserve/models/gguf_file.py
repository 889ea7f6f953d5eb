"""A memory-mapped GGUF reader: metadata and tensor views, without per-element Python objects.

``gguf.GGUFReader`` builds several numpy views per element of every metadata array; for a 262k-token
vocabulary (Gemma 3) that alone takes over half a minute. This reader decodes the header once with
``struct`` (string arrays as Python lists, numeric arrays as one ``np.frombuffer``) and gives each tensor the
same ``data`` layout as ``GGUFReader`` (numpy shape = GGUF dims reversed, quantized rows as bytes), so
``gguf.quants.dequantize(t.data, t.tensor_type)`` applies unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import struct
from typing import Any

import numpy as np

from jaxserve.errors import ModelLoadError

# GGUF metadata value types: struct format of the scalar ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# tensor types GGUFReader (and so gguf.quants.dequantize) hands over as typed arrays
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclasses.dataclass
class GGUFTensor:
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # GGUF order (ne0 first, the contiguous axis)
    data: np.ndarray            # a view of the file, numpy shape = shape reversed (last axis in bytes if quantized)


class GGUFFile:
    """``fields``: every metadata key → its value (str, int, float, bool, list[str], or a numpy array for
    numeric arrays); ``tensors``: ``GGUFTensor`` list in file order."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        name = os.path.basename(path)
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise ModelLoadError(f"{name}: file not found ({path})") from None
        buf = self._map
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported (2 and later are)")
            self._pos = 24
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                (vtype,) = self._unpack("<I")
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                tname = self._string()
                (n_dims,) = self._unpack("<I")
                dims = self._unpack(f"<{n_dims}Q")
                qtype, offset = self._unpack("<IQ")
                infos.append((tname, tuple(int(d) for d in dims), GGMLQuantizationType(qtype), offset))
            align = int(self.fields.get("general.alignment", 32))
            start = -(-self._pos // align) * align
            self.tensors = []
            for tname, dims, qtype, offset in infos:
                block, type_size = GGML_QUANT_SIZES[qtype]
                if dims[0] % block:
                    raise ValueError(f"tensor {tname}: row of {dims[0]} is not a multiple of its block {block}")
                row_bytes = dims[0] // block * type_size
                nbytes = row_bytes * int(np.prod(dims[1:], dtype=np.int64))
                lo = start + offset
                if lo + nbytes > len(buf):
                    raise ValueError(f"tensor {tname} runs past the end of the file")
                raw = buf[lo:lo + nbytes]
                rows = tuple(reversed(dims[1:]))
                typed = _TYPED.get(qtype.name)
                if typed is not None:   # what GGUFReader gives typed; every other type as row bytes
                    data = raw.view(typed).reshape(rows + (dims[0],))
                else:
                    data = raw.reshape(rows + (row_bytes,))
                self.tensors.append(GGUFTensor(tname, qtype, dims, data))
        except (ValueError, struct.error, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{name}: not a valid GGUF file ({type(e).__name__}: {e})") from None

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        s = bytes(self._map[self._pos + 8:self._pos + 8 + n]).decode("utf-8")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self._unpack("<IQ")
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
            arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return arr
        if etype == _STRING:
            return self._strings(count)
        return [self._value(etype) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """``count`` consecutive GGUF strings, decoded in one pass over a bytes copy of the region."""
        unpack = struct.Struct("<Q").unpack_from
        size = count * 24 + 4096            # a guess at the region's length, doubled while too short

        def window(size: int) -> bytes:     # slicing a bytes copy is far cheaper than slicing the memmap
            return self._map[self._pos:self._pos + size].tobytes()

        blob, pos, out = window(size), 0, []
        for _ in range(count):
            while pos + 8 > len(blob) or pos + 8 + unpack(blob, pos)[0] > len(blob):
                if self._pos + len(blob) >= len(self._map):
                    raise ValueError("string array runs past the end of the file")
                size *= 2
                blob = window(size)
            (n,) = unpack(blob, pos)
            out.append(blob[pos + 8:pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        self._pos += pos
        return out

    def metadata(self, max_array: int = 64) -> dict[str, Any]:
        """Scalar and short-array metadata (as plain Python values); an array longer than ``max_array`` is
        replaced by ``key#count`` (its length)."""
        out: dict[str, Any] = {}
        for key, value in self.fields.items():
            if isinstance(value, (list, np.ndarray)):
                if len(value) > max_array:
                    out[key + "#count"] = len(value)
                    continue
                value = value.tolist() if isinstance(value, np.ndarray) else list(value)
            out[key] = value
        return out


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    """A memory-mapped ``GGUFFile``, cached: the loader, the config and the tokenizer all read it."""
    return GGUFFile(path)


# ggml block layouts of the two types the embedded SmolLM2 uses (ggml-common.h): bytes per block, values
Q8_0, Q4_1 = 8, 3            # GGMLQuantizationType values
_BLOCK = {Q8_0: (34, 32), Q4_1: (20, 32)}


def dequantize(data: np.ndarray, tensor_type) -> np.ndarray:
    """A tensor's quantized rows (``GGUFTensor.data``) → float32 in its numpy shape. Q8_0 and Q4_1 as a few
    whole-tensor numpy operations (``gguf.quants`` works 16 rows at a time: ~10x slower on the embedded
    model), every other type through ``gguf.quants``; the values are the same bit for bit."""
    qtype = int(tensor_type)
    if qtype not in _BLOCK:
        from gguf.quants import dequantize as gguf_dequantize
        return gguf_dequantize(data, tensor_type)
    nbytes, nvals = _BLOCK[qtype]
    rows = np.asarray(data).view(np.uint8)
    shape = (*rows.shape[:-1], rows.shape[-1] // nbytes * nvals)
    blocks = rows.reshape(-1, nbytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)          # [n, 1]
    if qtype == Q8_0:
        out = blocks[:, 2:].view(np.int8).astype(np.float32) * d
    else:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        out = np.empty((blocks.shape[0], nvals), np.float32)
        np.multiply(qs & 0x0F, d, out=out[:, :16])         # low nibbles: values 0..15, high: 16..31
        np.multiply(qs >> 4, d, out=out[:, 16:])
        out += m
    return out.reshape(shape)
