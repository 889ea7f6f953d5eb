"""The tokenizer a model gets: its folder's, the one a GGUF file's vocabulary describes, or the embedded SmolLM2
one (for dummy models and folders that ship none)."""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from typing import Any, Callable, TypeVar

import jax

from jaxserve.errors import ModelLoadError
from jaxserve.models import packaged
from jaxserve.models.gguf_file import open_gguf
from jaxserve.utils.startup_timeline import phase

logger = logging.getLogger(__name__)
T = TypeVar("T")


def with_tokenizer(make_tokenizer: Callable[[], Any], load: Callable[[], T]) -> tuple[T, Any]:
    """``(load(), make_tokenizer())``, the tokenizer built on a thread while ``load`` runs (importing
    transformers takes seconds; the weights' load is device and disk work). ``load``'s arrays are ready
    before the wait for the tokenizer starts, so the timeline's ``weights`` are the weights' own seconds and
    ``tokenizer wait`` what the tokenizer adds."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer = pool.submit(make_tokenizer)
        loaded = jax.block_until_ready(load())
        with phase("tokenizer wait"):
            return loaded, tokenizer.result()


@phase("config/tokenizer")
@functools.lru_cache(maxsize=4)
def gguf_tokenizer(path: str):
    """The HF fast tokenizer built from the GGUF file's own vocabulary (``gguf_tokenizer.py``)."""
    from jaxserve.models.gguf_tokenizer import tokenizer_from_gguf  # noqa: PLC0415

    return tokenizer_from_gguf(open_gguf(path).fields)


@phase("config/tokenizer")
def embedded_tokenizer():
    """The SmolLM2 tokenizer: from the embedded GGUF when the package is installed, else the copy committed
    under configs/tokenizers/smollm2 (written from that GGUF), so dummy models need no model package."""
    try:
        return gguf_tokenizer(packaged.embedded_model_path())
    except ModelLoadError:
        folder = packaged.DUMMY_CONFIG_DIR.parent / "tokenizers" / "smollm2"
        if not folder.is_dir():
            raise
        from transformers import AutoTokenizer  # noqa: PLC0415
        return AutoTokenizer.from_pretrained(str(folder))


@phase("config/tokenizer")
def folder_tokenizer(folder: str):
    has_tokenizer = any(os.path.exists(os.path.join(folder, f))
                        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_tokenizer:
        logger.warning("%s ships no tokenizer; using the embedded SmolLM2 tokenizer", folder)
        return embedded_tokenizer()
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
