"""Converted GGUF weights on disk, so that a warm start maps them instead of dequantizing the file again.

A GGUF load dequantizes every tensor on the host and runs a layout/cast jit per weight shape on the device
(3 s of a 4 s SmolLM2 start on CPU). The result — the family's weight pytree, in the dtype it is served
in — goes into one file next to the persistent compile cache: a header (the key and each leaf's offset,
shape and dtype), then the leaves' bytes, 64-byte aligned. A warm start memory-maps the file and copies
each leaf to the device. The key is the GGUF file (path, size, modification time, a hash of its first MiB),
the model config, the dtype, the weights' tree and jaxserve's source (a converter fix invalidates every
entry). An entry that is missing, stale or torn is rebuilt from the GGUF; a new entry replaces the older
ones of the same file and dtype, so the folder holds one copy per model and dtype.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import jax
import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "jaxserve-weights-v1"
_MAGIC = b"JAXSERVE-WEIGHTS\n"
_ALIGN = 64
# a larger model's converted copy is not written (an 8B GGUF would leave 16 GB of bf16 in the cache)
MAX_BYTES = 4 << 30


def directory_for(compile_cache_dir: str | None) -> str | None:
    return os.path.join(compile_cache_dir, "jaxserve-weights") if compile_cache_dir else None


def key_text(path: str, cfg, dtype, structure) -> str:
    """What the converted weights depend on (``structure``: the weights' pytree structure)."""
    from jaxserve.runner.program_cache import source_digest, stable_repr
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    # the file and the dtype first: they name the entry that a newer one replaces (``_owner``)
    return "\n".join([FORMAT, os.path.realpath(path), str(np.dtype(dtype)), f"{st.st_size} {st.st_mtime_ns} {head}",
                      stable_repr(cfg), str(structure), f"source {source_digest()}"])


def _file(directory: str, text: str) -> str:
    """``<file and dtype>-<whole key>.weights``: the first part names the entries that a new one replaces."""
    return os.path.join(directory, f"{_owner(text)}-{hashlib.sha256(text.encode()).hexdigest()}.weights")


def _owner(text: str) -> str:
    lines = text.split("\n", 3)
    return hashlib.sha256("\n".join(lines[1:3]).encode()).hexdigest()[:16]


def load(directory: str | None, text: str, structure):
    """The weights stored under ``text`` as device arrays in ``structure``, or None (missing, stale, torn)."""
    if directory is None:
        return None
    path = _file(directory, text)
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError):
        return None
    try:
        if bytes(mapped[:len(_MAGIC)]) != _MAGIC:
            raise ValueError("no header")
        n = int.from_bytes(bytes(mapped[len(_MAGIC):len(_MAGIC) + 8]), "little")
        start = len(_MAGIC) + 8
        header = json.loads(bytes(mapped[start:start + n]))
        if header["key"] != text or len(header["leaves"]) != structure.num_leaves:
            raise ValueError("another entry's key")
        leaves = []
        for off, shape, dtype in header["leaves"]:
            dt = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if off + size > len(mapped):
                raise ValueError("cut short")
            leaves.append(jax.device_put(mapped[off:off + size].view(dt).reshape(shape)))
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("converted weights %s are not usable (%s); converting the GGUF again",
                       os.path.basename(path), e)
        return None
    return jax.tree.unflatten(structure, leaves)


def store(directory: str | None, text: str, params, structure) -> None:
    """Write ``params`` under ``text`` (atomically; a failure only costs the next start the conversion).
    Only weights of ``structure`` made of plain arrays (not quantized leaves of another tree), up to
    ``MAX_BYTES``."""
    leaves, tree = jax.tree.flatten(params)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    if directory is None or total > MAX_BYTES or tree != structure:
        return
    path = _file(directory, text)
    entries, off = [], 0
    for x in leaves:
        entries.append([off, list(x.shape), np.dtype(x.dtype).name])
        off += -(-x.size * x.dtype.itemsize // _ALIGN) * _ALIGN
    # the leaves start after the header, whose length depends on their offsets: grow the header's slot
    # until it fits
    base = 0
    while True:
        header = json.dumps({"key": text, "leaves": [[o + base, s, d] for o, s, d in entries]}).encode()
        need = -(-(len(_MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
        if need <= base:
            break
        base = need
    tmp = f"{path}.{os.getpid()}.partial"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(b"\0" * (base - f.tell()))
            for (o, _, _), x in zip(entries, leaves):
                f.seek(o + base)
                f.write(memoryview(np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)))
            f.truncate(base + off)
        os.replace(tmp, path)
        # one entry per GGUF file and dtype: the older ones (another version of the file, of jaxserve) go
        for name in os.listdir(directory):
            if name.startswith(_owner(text) + "-") and name.endswith(".weights") and name != os.path.basename(path):
                os.unlink(os.path.join(directory, name))
    except OSError as e:
        logger.warning("cannot store the converted weights in %s (%s)", directory, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
