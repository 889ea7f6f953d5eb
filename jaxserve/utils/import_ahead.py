"""Imports started on a thread before the code that needs them runs, so a library whose import takes seconds
loads while this process waits on something else.

The tokenizer library is the case: every tokenizer jaxserve serves with is a ``transformers`` fast tokenizer,
and importing its class imports torch too where torch is installed. The front end needs those classes to
unpickle the tokenizer the engine core sends it; imported only then, they would cost their seconds after the
core is ready, with nothing left to overlap. transformers' lazy module is not safe to import from two threads
at once (a second importer can find a half-made module): code that needs the library while the import may be
running calls ``wait_tokenizer_imports`` first.
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
