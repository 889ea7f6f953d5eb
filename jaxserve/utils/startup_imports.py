"""What a jaxserve process imports at start-up, and when: the tokenizer library imported ahead on a thread,
and torch kept out of the processes that run only JAX.

Every tokenizer jaxserve serves with is a ``transformers`` fast tokenizer, and importing its class imports
torch too wherever torch is installed (seconds, and hundreds of MB, that jaxserve never uses: it runs on
JAX alone).

- The engine-core and worker processes run nothing but jaxserve: ``hide_torch`` makes transformers see no
  torch there, so their tokenizer costs its own import only.
- The front end needs the tokenizer classes to unpickle the tokenizer the engine core sends it; imported only
  then, they would cost their seconds after the core is ready, with nothing left to overlap.
  ``start_tokenizer_imports`` starts them on a thread while the core loads. transformers' lazy module is not
  safe to import from two threads at once (a second importer can find a half-made module): code that needs
  the library while that import may be running calls ``wait_tokenizer_imports`` first.
"""
from __future__ import annotations

import importlib
import logging
import sys
import threading

from jaxserve.utils.startup_timeline import phase

logger = logging.getLogger(__name__)

# (module, attribute): transformers' top-level names are lazy, so the attribute imports the class's module
TOKENIZER_LIBRARY = ("transformers", "PreTrainedTokenizerFast")

_thread: threading.Thread | None = None
_lock = threading.Lock()


def hide_torch() -> None:
    """Make this process see no torch (``import torch`` fails; ``importlib.util.find_spec`` answers None,
    which is how transformers asks). Only for a process that runs jaxserve's code alone, before anything
    imports transformers: never in a user's own process."""
    sys.modules.setdefault("torch", None)
    # transformers' import then warns that models are unavailable: true, and not this process's concern
    logging.getLogger("transformers").addFilter(lambda r: not str(r.msg).startswith("PyTorch was not found"))


def start_tokenizer_imports() -> None:
    """Start importing the tokenizer library on a thread (logged as the ``tokenizer imports`` phase), unless
    it is imported or being imported already."""
    global _thread
    module, attribute = TOKENIZER_LIBRARY
    with _lock:
        if _thread is not None or module in sys.modules:
            return
        _thread = threading.Thread(target=_import, args=(module, attribute), name="tokenizer-imports",
                                   daemon=True)
        _thread.start()


def wait_tokenizer_imports() -> None:
    """Return once a started import of the tokenizer library has ended (at once if none was started)."""
    with _lock:
        thread = _thread
    if thread is not None:
        thread.join()


@phase("tokenizer imports")
def _import(module: str, attribute: str) -> None:
    try:
        getattr(importlib.import_module(module), attribute)
    except Exception as e:  # noqa: BLE001 - the code that needs it imports it again and reports the error
        logger.debug("importing %s.%s ahead failed: %s", module, attribute, e)
