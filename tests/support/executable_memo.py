"""The tests' stand-in for JAX's persistent compilation cache: compiled executables kept in memory, per process.

The persistent cache is off in the tests (XLA:CPU crashes now and then deserializing a cached executable:
``jaxserve/runner/compile_cache.py``). Most test files build engines of the same tiny models, whose programs
are identical but traced from new functions, so without a cache each one compiles again. This memo answers a
compile whose key (JAX's own persistent-cache key: the module, the devices, the compile options, the backend)
it has seen in this process with the executable it already has: nothing is serialized or loaded. A program with
host callbacks (its executable holds the caller's Python functions) always compiles.
"""
from __future__ import annotations

import collections
import threading

MAX_EXECUTABLES = 512


def install(max_executables: int = MAX_EXECUTABLES) -> bool:
    """Wrap JAX's ``compile_or_get_cached`` (False where this JAX has no such function: compiles as before)."""
    from jax._src import compilation_cache, compiler

    original = getattr(compiler, "compile_or_get_cached", None)
    if original is None or getattr(original, "_memo", False):
        return original is not None
    memo: collections.OrderedDict[str, object] = collections.OrderedDict()
    lock = threading.Lock()

    def compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks, *args, **kwargs):
        def compile_():
            return original(backend, computation, devices, compile_options, host_callbacks, *args, **kwargs)

        if host_callbacks:
            return compile_()
        try:
            key = compilation_cache.get_cache_key(computation, devices, compile_options, backend)
        except Exception:           # a module JAX cannot key: compile it
            return compile_()
        with lock:
            exe = memo.get(key)
            if exe is not None:
                memo.move_to_end(key)
                return exe
        exe = compile_()
        with lock:
            memo[key] = exe
            while len(memo) > max_executables:
                memo.popitem(last=False)
        return exe

    compile_or_get_cached._memo = True
    compiler.compile_or_get_cached = compile_or_get_cached
    return True
