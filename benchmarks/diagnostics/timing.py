"""Device time measured from the host, shared by the kernel microbenchmarks.

Every figure waits for the device (``jax.block_until_ready``), and the first call (compilation, first touch
of the buffers) stays out of it.
"""
from __future__ import annotations

import statistics
import time

import jax


def chain_seconds(fn, *args, n_iter: int, reps: int) -> float:
    """Seconds per step of ``fn``, a jitted chain of ``n_iter`` dependent steps (nothing hoisted or
    overlapped): the median of ``reps`` timed calls, divided by ``n_iter``."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) / n_iter


def back_to_back_seconds(fn, *args, iters: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn``, one figure per repeat: ``iters`` calls dispatched back to back (launch
    gaps hide behind the previous call), blocked on the last."""
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            y = fn(*args)
        jax.block_until_ready(y)
        out.append((time.perf_counter() - t) / iters)
    return out
