"""The garbage collector set for a process that serves: start-up's objects out of its passes, and young
collections less often.

A loaded engine or server holds hundreds of thousands of long-lived container objects (modules, the
tokenizer's Python side, the web framework's routes, the model's pytrees), and at 256 concurrent streams the
per-step allocations (outputs, chunks, frames) start a young collection every few hundred objects, each
walking what is young and the per-request state promoted since. Measured with
``frontend_overhead.py`` (in git history; the server level, 256 streams, 2-core CPU): the collector
took 13 µs of the front end's CPU per token; with start-up frozen 6.4, and with a young generation of
10,000 objects as well ~0.6. ``gc.freeze`` moves everything alive now into a permanent generation the
collector skips (vLLM's server freezes too); objects made later are collected as usual (cycles among them
live a little longer: up to 10,000 allocations).
"""
from __future__ import annotations

import gc

# Net container allocations between young collections (CPython's default: 700); the older generations'
# thresholds stay (10, 10).
YOUNG_GENERATION_THRESHOLD = 10_000


def prepare_gc_for_serving() -> None:
    """Collect once, freeze what survives, and collect the young generation less often. Call when start-up
    is done, before serving (the server's process, the engine core's)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)
