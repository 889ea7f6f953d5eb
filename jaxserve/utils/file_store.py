"""Files keyed by what they were made from: the shared format of the stored step programs and converted weights.

An entry is ``magic, the key's length (8 bytes, little-endian), the key, the payload``. The key is a text of
everything the payload depends on (``stable_repr`` of the inputs, ``source_digest`` of jaxserve's code); a
reader compares it whole, so an entry made for another key (a file name's hash collided, a file was copied
over) or torn inside its header is never used. A writer fills a temporary file that then replaces the entry
in one step: a concurrent reader sees the old entry or the new one, never part of one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading
import types
from collections.abc import Callable
from typing import BinaryIO

import numpy as np


class StaleEntry(ValueError):
    """The file at an entry's path holds another key's entry, or one torn inside its header."""


def stable_repr(value) -> str:
    """A text that is equal exactly when ``value`` is (numpy arrays by their bytes, not numpy's abridged
    repr; modules and functions by name, not address)."""
    if isinstance(value, np.ndarray):
        return f"ndarray({value.dtype},{value.shape},{hashlib.sha256(np.ascontiguousarray(value)).hexdigest()})"
    if isinstance(value, functools.partial):
        return (f"partial({stable_repr(value.func)},{stable_repr(value.args)},"
                f"{stable_repr(sorted(value.keywords.items()))})")
    if isinstance(value, types.ModuleType):
        return f"module({value.__name__})"
    if callable(value) and hasattr(value, "__wrapped__"):          # functools.wraps (bind_mesh, jax.jit)
        return f"wraps({stable_repr(value.__wrapped__)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"fn({value.__module__}.{value.__qualname__})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={stable_repr(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{stable_repr(k)}:{stable_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value).__name__ + "(" + ",".join(stable_repr(v) for v in value) + ")"
    text = repr(value)
    if " at 0x" in text and hasattr(value, "__dict__"):        # a plain object (a model family): its state
        return f"{type(value).__module__}.{type(value).__qualname__}({stable_repr(vars(value))})"
    return text


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over jaxserve's Python source (the package and the kernels package it installs): an edit
    anywhere changes every key, so nothing stored is reused across code that could make it differently."""
    import jaxserve
    import jaxserve.kernels
    roots = sorted({os.path.dirname(os.path.realpath(m.__file__)) for m in (jaxserve, jaxserve.kernels)})
    roots = [r for r in roots if not any(r.startswith(o + os.sep) for o in roots)]    # kernels inside jaxserve/
    h = hashlib.sha256()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, os.path.dirname(root)).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def header(magic: bytes, key: bytes) -> bytes:
    """What an entry starts with: its payload begins at ``len(header(magic, key))``."""
    return magic + len(key).to_bytes(8, "little") + key


def read(path: str, magic: bytes, key: bytes, *, mapped: bool = False) -> tuple[bytes | np.memmap, int] | None:
    """The entry at ``path``, whole, and its payload's offset; ``mapped``: memory-mapped (uint8), not read.
    None when there is no file; ``StaleEntry`` when it is not ``key``'s entry."""
    try:
        if mapped:
            data = np.memmap(path, dtype=np.uint8, mode="r")
        else:
            with open(path, "rb") as f:
                data = f.read()
    except (OSError, ValueError):       # missing, unreadable, or empty (a map of 0 bytes)
        return None
    head = header(magic, key)
    if bytes(data[:len(head)]) != head:
        raise StaleEntry(f"{os.path.basename(path)} is another key's entry, or torn")
    return data, len(head)


def write(path: str, magic: bytes, key: bytes, write_payload: Callable[[BinaryIO], None]) -> None:
    """Write ``key``'s entry at ``path``: the header, then ``write_payload(file)`` (positioned after the
    header), atomically. A failure leaves no temporary file behind and is raised."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(header(magic, key))
            write_payload(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
