"""A step's small host inputs in two flat buffers: one host-to-device transfer each, shared by both jits.

A step has ~24 small arrays (token ids, positions, slots, block tables, sampling parameters, ...). Passed to
the jitted forward and sampler one by one, each becomes its own host-to-device copy (per device under tensor
parallelism) and its own argument to dispatch. Here the host concatenates them into one int32 and one float32
vector, puts the pair on the device once, and the jitted code slices them apart again (free: static offsets
into a small buffer).

A ``Layout`` is static (hashable): the name, shape and kind of each piece in order. It is a jit static
argument, so each distinct set of shapes (a token bucket, a sampler variant) is one compiled program, as
the shapes themselves were before.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# kind -> which buffer and how the int32 bits are read back
_FLOAT = "f32"
_INT = "i32"
_UINT = "u32"
_BOOL = "bool"


class Piece(NamedTuple):
    name: str
    shape: tuple[int, ...]
    kind: str


Layout = tuple[Piece, ...]


def _kind(a: np.ndarray) -> str:
    if a.dtype == np.float32:
        return _FLOAT
    if a.dtype == np.int32:
        return _INT
    if a.dtype == np.uint32:
        return _UINT
    if a.dtype == np.bool_:
        return _BOOL
    raise TypeError(f"cannot pack dtype {a.dtype}")


def pack(arrays: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, Layout]:
    """``{name: host array}`` (float32, int32, uint32 or bool) -> (int32 vector, float32 vector, layout)."""
    ints, floats, layout = [], [], []
    for name, a in arrays.items():
        a = np.asarray(a)
        kind = _kind(a)
        layout.append(Piece(name, tuple(a.shape), kind))
        flat = a.reshape(-1)
        if kind == _FLOAT:
            floats.append(flat)
        elif kind == _UINT:
            ints.append(flat.view(np.int32))
        elif kind == _BOOL:
            ints.append(flat.astype(np.int32))
        else:
            ints.append(flat)
    i = np.concatenate(ints) if ints else np.zeros(0, np.int32)
    f = np.concatenate(floats) if floats else np.zeros(0, np.float32)
    return i, f, tuple(layout)


def unpack(ints: jax.Array, floats: jax.Array | None, layout: Layout) -> dict[str, jax.Array]:
    """Inside jit: the pieces of ``pack``'s buffers, with their shapes and dtypes (``floats`` may be None when
    the layout has no float piece)."""
    out, oi, of = {}, 0, 0
    for name, shape, kind in layout:
        n = math.prod(shape)
        if kind == _FLOAT:
            x = floats[of:of + n].reshape(shape)
            of += n
        else:
            x = ints[oi:oi + n].reshape(shape)
            oi += n
            if kind == _UINT:
                x = jax.lax.bitcast_convert_type(x, jnp.uint32)
            elif kind == _BOOL:
                x = x != 0
        out[name] = x
    return out


def fields(obj) -> dict[str, Any]:
    """A dataclass pytree's array fields by name (for ``pack``); static fields are not arrays and stay out,
    and so do optional ones left None (the layout, hence the compiled program, is that of a step without
    them; ``unpack``'s dict then lacks them and the dataclass's default None comes back)."""
    return {f.name: v for f in dataclasses.fields(obj)
            if not f.metadata.get("static") and (v := getattr(obj, f.name)) is not None}


def prefixed(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    return {prefix + k: v for k, v in d.items()}


def take(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of ``d`` under ``prefix``, with it stripped."""
    n = len(prefix)
    return {k[n:]: v for k, v in d.items() if k.startswith(prefix)}
