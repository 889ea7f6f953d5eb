"""JAX's persistent compilation cache, on by default so a restart skips most of the warm-up compiles."""
from __future__ import annotations

import os

import jax

from jaxserve import envs

_enabled_dir: str | None = None


def default_dir() -> str:
    return os.path.join(envs.XDG_CACHE_HOME, "jaxserve", "xla")


def enable(directory: str | None) -> str | None:
    """Turn the cache on at ``directory`` (None = the default folder, "" = off). Returns the folder used."""
    global _enabled_dir
    if directory == "":
        return None
    if jax.config.jax_compilation_cache_dir and _enabled_dir is None:
        return jax.config.jax_compilation_cache_dir      # someone (a test, the user) already chose one
    directory = directory or default_dir()
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # every executable: a sampler variant compiles in well under a second (JAX's default threshold is 1 s)
    # but a warm start loads dozens of them, and the loader's per-shape casts too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _enabled_dir = directory
    return directory
