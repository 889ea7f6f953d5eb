"""Take what a process built at start-up out of the garbage collector's full passes.

A loaded engine or server holds hundreds of thousands of long-lived container objects (modules, the
tokenizer's Python side, the web framework's routes, the model's pytrees); every full collection walks them
all, and at 256 concurrent streams the per-step allocations trigger collections often: a quarter of the
front end's CPU per token went to the collector (``benchmarks/diagnostics/frontend_overhead.py``).
``gc.freeze`` moves everything alive now into a permanent generation the collector skips (vLLM's server
does the same after start-up); objects made later are collected as usual.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then freeze what survives (call when start-up is done, before serving)."""
    gc.collect()
    gc.freeze()
