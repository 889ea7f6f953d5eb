"""Converted GGUF weights on disk, so that a warm start maps them instead of dequantizing the file again.

A GGUF load dequantizes its tensors (or repacks its quantized projections) on the host and runs a layout/cast jit
per weight shape on the device (most of a small model's start on CPU). The result — the family's weight pytree, in
the dtype it is served in, int4 leaves included — goes into one ``jaxserve.utils.file_store`` entry next to the
persistent compile cache, or in ``weights/`` under jaxserve's cache folder when there is none (the CPU backend's
default): after the entry's header (the key), a table of each leaf's offset, shape and dtype, then the leaves'
bytes, 64-byte aligned. A warm start memory-maps the file and copies each leaf to the device. The key is the GGUF
file (path, size, modification time, a hash of its first MiB), the model config, the dtype, the weights' tree and
jaxserve's source (a converter fix invalidates every entry). An entry that is missing, stale or torn is rebuilt from
the GGUF; a new entry replaces the older ones of the same file and dtype, so the folder holds one copy per model and
dtype.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import jax
import numpy as np

from jaxserve.models import packaged
from jaxserve.utils import file_store

logger = logging.getLogger(__name__)

FORMAT = "jaxserve-weights-v2"
_MAGIC = b"JAXSERVE-WEIGHTS\n"
_ALIGN = 64
# a larger model's converted copy is not written (an 8B GGUF would leave 16 GB of bf16 in the cache)
MAX_BYTES = 4 << 30


def directory_for(compile_cache_dir: str | None) -> str:
    """Inside the persistent compile cache's folder when there is one, else ``$JAXSERVE_CACHE_DIR/weights``."""
    if compile_cache_dir:
        return os.path.join(compile_cache_dir, "jaxserve-weights")
    return str(packaged.cache_dir() / "weights")


def key_text(path: str, cfg, dtype, structure) -> str:
    """What the converted weights depend on (``structure``: the weights' pytree structure)."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    # the file and the dtype first: they name the entry that a newer one replaces (``_owner``)
    return "\n".join([FORMAT, os.path.realpath(path), str(np.dtype(dtype)), f"{st.st_size} {st.st_mtime_ns} {head}",
                      file_store.stable_repr(cfg), str(structure), f"source {file_store.source_digest()}"])


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
        entry = file_store.read(path, _MAGIC, text.encode(), mapped=True)
        if entry is None:
            return None
        mapped, start = entry
        n = int.from_bytes(bytes(mapped[start:start + 8]), "little")
        table = json.loads(bytes(mapped[start + 8:start + 8 + n]))
        if len(table) != structure.num_leaves:
            raise ValueError("another tree's leaves")
        leaves = []
        for off, shape, dtype in table:
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
    key = text.encode()
    entries, off = [], 0
    for x in leaves:
        entries.append([off, list(x.shape), np.dtype(x.dtype).name])
        off += -(-x.size * x.dtype.itemsize // _ALIGN) * _ALIGN
    # the leaves start after the leaf table, whose length depends on their offsets: grow the table's slot
    # until it fits
    head, base = len(file_store.header(_MAGIC, key)), 0
    while True:
        table = json.dumps([[o + base, s, d] for o, s, d in entries]).encode()
        need = -(-(head + 8 + len(table)) // _ALIGN) * _ALIGN
        if need <= base:
            break
        base = need

    def payload(f):
        f.write(len(table).to_bytes(8, "little") + table)
        f.write(b"\0" * (base - f.tell()))
        for (o, _, _), x in zip(entries, leaves):
            f.seek(o + base)
            f.write(memoryview(np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)))
        f.truncate(base + off)
    try:
        file_store.write(path, _MAGIC, key, payload)
        # one entry per GGUF file and dtype: the older ones (another version of the file, of jaxserve) go
        for name in os.listdir(directory):
            if name.startswith(_owner(text) + "-") and name.endswith(".weights") and name != os.path.basename(path):
                os.unlink(os.path.join(directory, name))
    except OSError as e:
        logger.warning("cannot store the converted weights in %s (%s)", directory, e)
