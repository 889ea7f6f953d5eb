"""The step's executables, compiled ahead of time on a thread pool, the first-needed first.

Each variant (a forward per token bucket, a sampler per request count and mode, ...) has a hashable key and
a ``lower(key)`` that traces and lowers it (``jax.jit(...).lower(...)``); this module compiles the result. Executables
are called directly, so a step never compiles behind the caller's back: a key that is not compiled yet is
either avoided by the caller (a forward pads up to a compiled bucket) or compiled on first use by ``need``,
which logs it and counts it.

Why threads: tracing and lowering hold the GIL (and run one at a time), but XLA's compile (and a
persistent-cache load) runs in C++ without it, so the compiles of independent variants overlap.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable

logger = logging.getLogger(__name__)

# JAX's tracing is not thread-safe (concurrent traces of lax.cond raced on shared state), and it holds the
# GIL anyway: one trace + lower at a time in the process (anything lowering on a thread takes it); the
# compiles themselves overlap
TRACE_LOCK = threading.Lock()


def default_workers() -> int:
    """One compile thread per core, at most 8 (more only add tracing contention for the GIL)."""
    return max(1, min(8, os.cpu_count() or 1))


class StepCompiler:
    """Compiles keys with ``build`` on ``workers`` threads in priority order; ``get`` never waits."""

    def __init__(self, lower: Callable[[Hashable], object], workers: int | None = None):
        self._lower = lower
        self.workers = workers or default_workers()
        self._ready: dict[Hashable, object] = {}
        self._events: dict[Hashable, threading.Event] = {}   # started or queued keys -> done
        self._num_pending = 0                                 # events not set yet (``pending``: no lock, no pass)
        self._errors: dict[Hashable, BaseException] = {}
        self._queue: list[tuple[int, int, Hashable]] = []    # (priority, order, key): a heap
        self._queued: set[Hashable] = set()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.seconds: dict[Hashable, float] = {}             # key -> wall seconds its compile took
        self.on_first_use: list[Hashable] = []               # keys a step had to wait for (``need``)

    # ------------------------------------------------------------------ lookups (hot path)
    def get(self, key: Hashable):
        """The compiled executable, or None when it is not compiled yet."""
        return self._ready.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ready

    def __len__(self) -> int:
        return len(self._ready)

    def keys(self) -> list[Hashable]:
        return list(self._ready)

    def need(self, key: Hashable, why: str = "first use"):
        """The executable now: compiled on this thread when nobody has started it, else waited for (a step
        that waits is logged and counted in ``on_first_use``)."""
        exe = self._ready.get(key)
        if exe is not None:
            return exe
        t0 = time.perf_counter()
        exe = self._wait_or_compile(key, record=True)
        logger.info("compiled %s on %s: a step waited %.2f s", _name(key), why, time.perf_counter() - t0)
        return exe

    def _wait_or_compile(self, key: Hashable, record: bool):
        with self._lock:
            if record:
                self.on_first_use.append(key)
            ev = self._events.get(key)
            mine = ev is None or key in self._queued          # queued, not started: take it over
            if mine:
                self._queued.discard(key)
                if ev is None:
                    ev = self._events[key] = threading.Event()
                    self._num_pending += 1
        if mine:
            self._compile(key, ev)
        else:
            ev.wait()
        if key in self._errors:
            raise self._errors[key]
        return self._ready[key]

    # ------------------------------------------------------------------ compiling
    def compile_now(self, keys: Iterable[Hashable]) -> None:
        """Compile ``keys`` concurrently (this thread helps) and return when all are done."""
        keys = [k for k in dict.fromkeys(keys) if k not in self._ready]
        self.submit(keys, priority=-1)
        for k in keys:
            self._wait_or_compile(k, record=False)

    def submit(self, keys: Iterable[Hashable], priority: int = 0) -> None:
        """Queue ``keys`` for the background threads (lower priority first, then in order given)."""
        with self._lock:
            if self._stopping:
                return
            for k in keys:
                if k in self._events:
                    continue
                self._events[k] = threading.Event()
                self._num_pending += 1
                self._queued.add(k)
                heapq.heappush(self._queue, (priority, next(self._order), k))
            self._start_threads()

    def pending(self) -> int:
        """Keys queued or compiling (a counter: the engine reports it every step)."""
        return self._num_pending

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every submitted key is compiled; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                waiting = [ev for ev in self._events.values() if not ev.is_set()]
            if not waiting:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            waiting[0].wait(left)

    def stop(self, wait: bool = True) -> None:
        """Drop what is queued; ``wait``: for the compiles in progress too (the threads end after them)."""
        with self._lock:
            self._stopping = True
            for _, _, k in self._queue:
                if k in self._queued:
                    self._queued.discard(k)
                    self._events.pop(k).set()       # never compiled: wait_all must not wait for it
                    self._num_pending -= 1
            self._queue.clear()
            threads = list(self._threads) if wait else []
        for t in threads:
            t.join()

    def _start_threads(self) -> None:
        # not daemon threads: the interpreter joins them before its exit hooks run. At exit
        # ``weakref.finalize`` fires every live finalizer, and JAX's tracer drops a constant of the trace in
        # progress through one (a cond branch's closed-over values): a trace still running on a daemon thread
        # then lowers to a broken program (a KeyError on a jaxpr Var, a shape error). A thread finishes the
        # compile it is in and takes no other key once the main thread has returned.
        while len(self._threads) < min(self.workers, len(self._queue)) and _main_thread_running():
            t = threading.Thread(target=self._work, name=f"step-compiler-{len(self._threads)}")
            self._threads.append(t)
            t.start()

    def _work(self) -> None:
        # a thread ends once the queue is empty (``submit`` starts new ones): a finished compiler holds no
        # thread, so the runner it compiles for (weights, KV cache) can be freed
        while True:
            with self._lock:
                if self._stopping or not self._queue or not _main_thread_running():
                    self._threads.remove(threading.current_thread())
                    return
                _, _, key = heapq.heappop(self._queue)
                if key not in self._queued:            # ``need`` took it over
                    continue
                self._queued.discard(key)
                ev = self._events[key]
            self._compile(key, ev)

    def _compile(self, key: Hashable, ev: threading.Event) -> None:
        t0 = time.perf_counter()
        for attempt in (1, 2):
            try:
                with TRACE_LOCK:
                    lowered = self._lower(key)
                exe = lowered.compile()
            except Exception as e:
                # one retry (JAX does not promise thread-safe tracing, and a trace elsewhere in the process
                # does not take TRACE_LOCK); a second failure is surfaced to whoever needs the key
                logger.warning("compiling %s failed (attempt %d): %r", _name(key), attempt, e)
                if attempt == 2:
                    self._errors[key] = e
            else:
                self._ready[key] = exe
                break
        self.seconds[key] = time.perf_counter() - t0
        with self._lock:
            self._num_pending -= 1
        ev.set()


def _main_thread_running() -> bool:
    return threading.main_thread().is_alive()


def _name(key) -> str:
    """A key for a log line, without its (long) layouts."""
    if isinstance(key, tuple):
        return "(" + ", ".join(str(k) for k in key if not isinstance(k, tuple)) + ")"
    return str(key)
