"""The start-up timeline: where the seconds between a process start and a ready engine go, one INFO line per
phase (``start-up PHASE: SECONDS s (DETAIL)``), kept in this process's ``timeline()`` too.

The phases, in order: ``imports`` (interpreter start to the engine code loaded; the engine-core process logs its
own), ``device init`` (the JAX backend and the mesh), ``weights`` (bytes and GB/s; the device's fills or copies
included; then ``by storage:`` int4 / fp8 with their bits per weight, float dtypes), ``tokenizer wait`` (the load's
wait for the tokenizer built beside it), ``KV cache`` (sizing and allocating it), ``warm-up`` (the first-needed
compiles) and ``engine-core hand-shake`` (the front end's wait for a core process beyond the core's own wall time:
its interpreter, the pickled facts, reading them). A phase opened inside another one on the same thread is not
counted in its parent's seconds, so the phases of a thread add up to its wall time. A phase that ends on another
thread than the main one runs beside the others (``config/tokenizer``: the tokenizer built while the weights load;
``tokenizer imports``: its library imported ahead, ``startup_imports``): its line says ``overlapped`` and the
summary's total leaves it out. The start-up benchmark (``benchmarks/startup.py``) reads the lines from the server's
log; ``LINE`` is their pattern.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

logger = logging.getLogger("jaxserve.startup")

PHASES = ("imports", "device init", "tokenizer imports", "config/tokenizer", "weights", "tokenizer wait", "KV cache",
          "warm-up", "engine-core hand-shake")
OVERLAPPED = "overlapped"     # the detail of a phase that ran beside the main thread's
LINE = r"start-up ([a-zA-Z/ -]+): ([0-9.]+) s"

_recorded: list[tuple[str, float, str]] = []
_open = threading.local()


class _Phase:
    """An open phase: set ``nbytes`` to log its size and rate, ``note`` to add a phrase after them."""

    def __init__(self, name: str):
        self.name = name
        self.nested_s = 0.0
        self.nbytes: int | None = None
        self.note = ""


def record(name: str, seconds: float, detail: str = "", note: str = "") -> None:
    """Log a phase: ``start-up NAME: SECONDS s (DETAIL), NOTE`` (``note`` is in the log line only)."""
    _recorded.append((name, seconds, detail))
    logger.info("start-up %s: %.2f s%s%s", name, seconds, f" ({detail})" if detail else "", f", {note}" if note else "")


@contextlib.contextmanager
def phase(name: str):
    """Time the block as phase ``name`` (logged when it ends without an error); inside an open phase of the
    same name, the block is part of that one."""
    stack = _open.__dict__.setdefault("stack", [])
    if stack and stack[-1].name == name:
        yield stack[-1]
        return
    p = _Phase(name)
    stack.append(p)
    t0 = time.perf_counter()
    try:
        yield p
    finally:
        stack.pop()
    total = time.perf_counter() - t0
    if stack:
        stack[-1].nested_s += total
    seconds = total - p.nested_s
    details = [] if p.nbytes is None else [rate(p.nbytes, seconds)]
    if threading.current_thread() is not threading.main_thread():
        details.append(OVERLAPPED)
    record(name, seconds, "; ".join(details), p.note)


def rate(nbytes: int, seconds: float) -> str:
    gb = nbytes / 1e9
    return f"{gb:.2f} GB, {gb / seconds:.2f} GB/s" if seconds > 0 else f"{gb:.2f} GB"


def timeline() -> list[tuple[str, float, str]]:
    """This process's phases so far: (name, seconds, detail), in the order they ended."""
    return list(_recorded)


def add_from_another_process(phases) -> None:
    """Phases another process (the engine core) logged itself: kept here for ``summary``, not logged again."""
    _recorded.extend(tuple(p) for p in phases)


def is_overlapped(detail: str) -> bool:
    return detail.endswith(OVERLAPPED)


def summary() -> str:
    """One line of every phase of this start-up, with the sum of those that did not overlap others."""
    return ", ".join(f"{name} {s:.1f} s" + (f" ({OVERLAPPED})" if is_overlapped(d) else "")
                     for name, s, d in _recorded) + \
        f"; total {sum(s for _, s, d in _recorded if not is_overlapped(d)):.1f} s"


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def record_imports() -> None:
    """The ``imports`` phase: from the process start to now."""
    seconds = seconds_since_process_start()
    if seconds is not None:
        record("imports", seconds)
