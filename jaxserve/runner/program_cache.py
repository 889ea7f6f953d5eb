"""Exported step programs on disk, so that a warm start compiles its step variants without tracing the model.

JAX's persistent compilation cache is keyed by the lowered module, so a start with that cache full still
traces and lowers every variant just to compute the key (over a second per forward of 30 unrolled layers on
CPU). This cache keys a variant by what determines its program instead — the function and its bound
arguments (model config, runner settings), the variant's static arguments, the shapes, dtypes and shardings
of its inputs, jaxserve's source, the jax/jaxlib version and the devices — and stores the variant's
``jax.export`` (its StableHLO). A hit deserializes that and lowers a thin call of it (milliseconds: the
model's module is embedded as it is), which the persistent cache then finds compiled. Cold and warm starts
both compile the call of the exported module, so both run the same executable. A missing, stale or
unreadable entry, and a call that does not lower, fall back to tracing (and rewrite the entry).

Why export rather than serialized executables (``jax.experimental.serialize_executable``): on CPU an
executable that came from the persistent cache serializes into one that fails to run (``NOT_FOUND: Function
wrapped_iota not found``), and the persistent cache has to stay (it also holds every other jit's programs).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os

import jax
import numpy as np

from jaxserve.utils import file_store
from jaxserve.utils.file_store import source_digest, stable_repr

logger = logging.getLogger(__name__)

# bump when what an entry holds, or how the key is made, changes
FORMAT = "jaxserve-program-v1"
_MAGIC = b"JAXSERVE-PROGRAM\n"
# jax settings a trace reads (what the persistent cache's key covers through the module itself)
_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                "jax_numpy_dtype_promotion", "jax_default_prng_impl", "jax_threefry_partitionable",
                "jax_use_shardy_partitioner", "jax_softmax_custom_jvp", "jax_enable_checks",
                "jax_debug_nans", "jax_debug_infs", "jax_dynamic_shapes")

# environment variables that differ run to run (or process to process) without changing a program: XLA's flags
# and memory share act after export (the persistent compile cache keys the flags itself; the KV cache's size is
# in the inputs' shapes)
_PER_RUN = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID", "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def directory_for(compile_cache_dir: str | None) -> str | None:
    """The program folder inside the persistent cache's folder (None: no persistent cache, no programs)."""
    return os.path.join(compile_cache_dir, "jaxserve-programs") if compile_cache_dir else None


def _signature(args) -> str:
    """The inputs as a program sees them: tree structure, and each leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{tuple(x.shape)}:{np.dtype(x.dtype)}:{sharding!r}")
    return "\n".join(parts)


def _environment() -> str:
    """What every program depends on: versions, devices, the jax settings and jaxserve switches a trace
    reads (every registered environment variable but the secrets), and the source."""
    import jaxlib

    from jaxserve import envs
    devices = jax.devices()
    flags = {name: getattr(jax.config, name, None) for name in _TRACE_FLAGS}
    switches = {name: getattr(envs, name) for name in envs.non_secret_names() if name not in _PER_RUN}
    return "\n".join([FORMAT, f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
                      f"{jax.default_backend()} {devices[0].client.platform_version}",
                      f"{len(devices)} x {devices[0].device_kind}, {jax.process_count()} processes",
                      stable_repr(flags), stable_repr(switches), f"source {source_digest()}"])


class ProgramCache:
    """``lower(name, jitted, args, static, **jit_kwargs)``: the variant ``name`` of ``jitted`` lowered for
    ``args`` (shapes) with static keyword arguments ``static``, from its stored export when one matches."""

    def __init__(self, directory: str | None, context: str = ""):
        self.directory = directory
        self.context = context
        self.hits = self.misses = 0
        self._environment = _environment() if directory else ""

    def key_text(self, name, jitted, args, static: dict, jit_kwargs: dict) -> str:
        return "\n".join([self._environment, self.context, stable_repr(name), stable_repr(jitted),
                          stable_repr(sorted(static.items())), stable_repr(sorted(jit_kwargs.items())),
                          _signature(args)])

    def lower(self, name, jitted, args: tuple, static: dict, **jit_kwargs):
        """The lowered call of the stored export (its ``compile()`` traces afresh if that fails), or on a
        miss the traced variant's export, stored, then lowered the same way."""
        if self.directory is None:
            return jitted.lower(*args, **static)
        text = self.key_text(name, jitted, args, static, jit_kwargs).encode()
        if b" at 0x" in text:                   # an address in the key: it would never match again
            logger.warning("step variant %s has no stable key; it traces on every start", _short(name))
            return jitted.lower(*args, **static)
        path = os.path.join(self.directory, hashlib.sha256(text).hexdigest() + ".jaxexport")

        def trace():
            try:
                exported = jax.export.export(jitted, disabled_checks=[
                    jax.export.DisabledSafetyCheck.custom_call("ALL")])(*args, **static)
            except Exception as e:              # noqa: BLE001 — not exportable: the plain jit, not stored
                logger.warning("step variant %s is not exportable (%s: %s); it traces on every start",
                               _short(name), type(e).__name__, e)
                return jitted.lower(*args, **static)
            try:
                lowered = jax.jit(exported.call, **jit_kwargs).lower(*args)
            except Exception as e:              # noqa: BLE001 — its call does not lower: the plain jit
                logger.warning("step variant %s's exported program does not lower (%s: %s); it traces on "
                               "every start", _short(name), type(e).__name__, e)
                return jitted.lower(*args, **static)
            self._write(path, text, exported)
            return lowered

        _register_step_types()                  # before a stored program's trees are read back
        exported = self._read(path, text)
        if exported is not None:
            try:
                lowered = jax.jit(exported.call, **jit_kwargs).lower(*args)
            except Exception as e:              # noqa: BLE001 — any failure: trace as if it were not there
                logger.warning("stored program %s does not lower (%s: %s); tracing it again",
                               os.path.basename(path), type(e).__name__, e)
            else:
                self.hits += 1
                return _StoredLowering(lowered, trace, path)
        self.misses += 1
        return trace()

    @staticmethod
    def _read(path: str, text: bytes):
        try:
            entry = file_store.read(path, _MAGIC, text)
        except file_store.StaleEntry:           # another key's entry, or a torn or foreign file
            logger.warning("stored program %s is not this variant's; tracing it again", os.path.basename(path))
            return None
        if entry is None:
            return None
        blob, start = entry
        try:
            return jax.export.deserialize(bytearray(memoryview(blob)[start:]))
        except Exception as e:                  # noqa: BLE001
            logger.warning("stored program %s does not load (%s: %s); tracing it again",
                           os.path.basename(path), type(e).__name__, e)
            return None

    def _write(self, path: str, text: bytes, exported) -> None:
        try:
            _register_step_types()
            blob = exported.serialize()
            file_store.write(path, _MAGIC, text, lambda f: f.write(blob))
        except Exception as e:                  # noqa: BLE001 — the run goes on; the next start traces again
            logger.warning("cannot store step program %s (%s: %s)", os.path.basename(path), type(e).__name__, e)


@functools.lru_cache(maxsize=1)
def _register_step_types() -> None:
    """The step outputs' own pytree types, named for ``Exported.serialize`` (once per process)."""
    from jaxserve.quantization.weights import Fp8Weight, Int4Weight
    from jaxserve.runner.rejection_sampler import SpecOutput
    from jaxserve.runner.sampler import SamplerOutput
    jax.export.register_namedtuple_serialization(SamplerOutput, serialized_name="jaxserve.SamplerOutput")
    jax.export.register_namedtuple_serialization(SpecOutput, serialized_name="jaxserve.SpecOutput")
    # quantized parameters: dataclass pytrees whose static fields (group size, block, tp axis) are the aux data
    for cls in (Int4Weight, Fp8Weight):
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=f"jaxserve.{cls.__name__}",
            serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
            deserialize_auxdata=lambda data: tuple(json.loads(data)))


class _StoredLowering:
    """A stored program's lowering: ``compile()`` as the lowering's, or, when that fails (a custom call this
    process has not registered, say), the variant traced afresh and its entry rewritten."""

    def __init__(self, lowered, trace, path: str):
        self._lowered, self._trace, self._path = lowered, trace, path

    def compile(self):
        try:
            return self._lowered.compile()
        except Exception as e:                  # noqa: BLE001
            logger.warning("stored program %s does not compile (%s: %s); tracing it again",
                           os.path.basename(self._path), type(e).__name__, e)
        from jaxserve.runner.step_compiler import TRACE_LOCK
        with TRACE_LOCK:
            lowered = self._trace()
        return lowered.compile()


def _short(name) -> str:
    return str(name[:3]) if isinstance(name, tuple) else str(name)
