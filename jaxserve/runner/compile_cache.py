"""JAX's persistent compilation cache, on by default on a GPU so a restart skips most of the warm-up compiles.

On the CPU backend it is off unless a folder is named: XLA:CPU crashes the process (SIGSEGV, or SIGABRT) now
and then while deserializing a cached executable (``compilation_cache.get_executable_and_time`` →
``deserialize_executable``), which a server must not risk to save start-up seconds on a development machine.
"""
from __future__ import annotations

import logging
import os

import jax

from jaxserve import envs

logger = logging.getLogger(__name__)

_enabled_dir: str | None = None


def default_dir() -> str:
    return os.path.join(envs.XDG_CACHE_HOME, "jaxserve", "xla")


def enable(directory: str | None) -> str | None:
    """Turn the cache on at ``directory`` (None = the default folder on a GPU, off on the CPU backend; "" = off).
    Returns the folder used."""
    global _enabled_dir
    if directory == "":
        return None
    if jax.config.jax_compilation_cache_dir and _enabled_dir is None:
        return jax.config.jax_compilation_cache_dir      # someone (a test, the user) already chose one
    if directory is None and _enabled_dir is None and jax.default_backend() == "cpu":
        logger.info("no persistent compilation cache on the CPU backend (XLA:CPU can crash loading a cached "
                    "executable); --compilation-cache-dir DIR turns it on")
        return None
    directory = directory or default_dir()
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # every executable: a sampler variant compiles in well under a second (JAX's default threshold is 1 s)
    # but a warm start loads dozens of them, and the loader's per-shape casts too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _enabled_dir = directory
    return directory
