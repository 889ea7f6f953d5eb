"""The grammar compiler: constraints compiled off the caller's thread, each distinct one once, on a bounded
pool of worker threads with a large stack, under a time budget, into a cache bounded in bytes.

Who calls it: the front end submits a request's constraint before accepting the request and awaits the
future (a bad or over-limit constraint is a 400 before any response header); the engine core submits it when
the request is queued and leaves the request waiting until the future is done, so its step loop never
compiles. Several askers of one constraint share one compile; an asker that cancels its future (a request
aborted while it waits) drops its interest, and a compile nobody waits for any more is dropped before it
starts.

NOTE: llguidance compiles recursively on the calling thread's stack, one frame chain per rule or ``$ref``
level, and a thread's default stack overflows (a segmentation fault: the whole server) on chains a request
can easily spell. The workers get a stack sized from the limits on those chains, with a wide margin. A
compile cannot be interrupted (it runs in Rust without the GIL), and its matcher cannot leave the process
it was built in, so a child process would mean compiling everything twice: instead a compile over its time
budget fails its askers at the deadline, its worker is replaced (up to the pool's size in such abandoned
workers at once) and finishes in the background, and its result, if any, replaces the failure in the cache.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

from jaxserve.errors import InvalidRequestError

from .grammar import excerpt, release_free_heap
from .limits import NOUN_OF_KIND, PARAM_OF_KIND, StructuredOutputsLimits, check_constraint, \
    check_constraint_size, constraint_key, over_limit

logger = logging.getLogger(__name__)

WORKER_PREFIX = "jaxserve-grammar"
# stack bytes per admitted level of a rule chain / JSON nesting: several times what llguidance uses
STACK_PER_RULE = 16 << 10
STACK_PER_SCHEMA_LEVEL = 16 << 10
MIN_STACK_BYTES = 256 << 20
MIN_FALLBACK_STACK_BYTES = 32 << 20     # above what the default limits' deepest chains use
# freed grammar bytes after which the allocator is asked to hand free pages back
TRIM_AFTER_BYTES = 32 << 20
_VERDICT_BYTES = 1 << 10
WORKER_NICE = 10        # the workers' nice value: compiles are background work beside serving

_stack_size_lock = threading.Lock()     # threading.stack_size is process-wide


def worker_stack_bytes(limits: StructuredOutputsLimits) -> int:
    """The workers' stack: enough for the deepest rule chain and JSON nesting the limits admit."""
    need = STACK_PER_RULE * limits.max_grammar_rules + STACK_PER_SCHEMA_LEVEL * limits.max_json_schema_depth
    return max(MIN_STACK_BYTES, -(-need // (1 << 20)) << 20)


@dataclasses.dataclass(slots=True)
class _Entry:
    value: Any                          # the compiled grammar (None when failed, or when not retained)
    error: InvalidRequestError | None
    nbytes: int


@dataclasses.dataclass(eq=False, slots=True)
class _Job:
    key: tuple
    params: Any
    waiters: list = dataclasses.field(default_factory=list)
    taken: bool = False                 # a worker took it off the queue
    deadline: float | None = None       # set when its compile starts
    timed_out: bool = False
    replaced: bool = False              # its worker was replaced when it timed out, and exits after it


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` with ``compile_fn`` (params -> an object with ``nbytes``;
    raises InvalidRequestError) on ``workers`` threads. ``prepare`` runs on a worker before the first
    timed compile (building the tokenizer is not the grammar's time). ``retain=False`` keeps only verdicts
    (a front end that validates while another process generates): futures then resolve to None."""

    def __init__(self, compile_fn: Callable[[Any], Any], limits: StructuredOutputsLimits | None = None, *,
                 prepare: Callable[[], Any] | None = None, workers: int = 2, retain: bool = True):
        self.limits = limits or StructuredOutputsLimits()
        self._compile_fn, self._prepare = compile_fn, prepare
        self.workers, self.retain = max(int(workers), 1), retain
        self.stack_bytes = worker_stack_bytes(self.limits)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)        # workers wait for jobs
        self._watch = threading.Condition(self._lock)       # the watchdog waits for deadlines
        self._cache: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._jobs: dict[tuple, _Job] = {}        # queued or running, by key
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: set[_Job] = set()
        self._threads: list[threading.Thread] = []
        self._watchdog: threading.Thread | None = None
        self._abandoned = 0
        self._names = itertools.count()
        self._freed_since_trim = 0
        self._closed = False
        self.cache_bytes = 0
        self.compilations = 0
        self.compile_threads: collections.Counter[str] = collections.Counter()   # thread name -> compiles
        self.cache_hits = self.evictions = self.timeouts = self.cancelled = 0

    # ---------------------------------------------------------------- asking
    def submit(self, params) -> concurrent.futures.Future:
        """A future of the constraint's compiled grammar (this asker's own: cancelling it drops only its
        interest). Fails with InvalidRequestError: over a limit, not compiling, over the time budget."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            key = constraint_key(params)
            check_constraint_size(params.kind, key[1], params.choice, self.limits)
        except InvalidRequestError as e:
            future.set_exception(e)
            return future
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
            else:
                job = self._jobs.get(key)
                if job is None:
                    job = self._jobs[key] = _Job(key, params)
                    self._queue.append(job)
                    self._start_threads()
                    self._work.notify()
                job.waiters.append(future)
        if entry is not None:
            _resolve(future, entry)
        else:
            future.add_done_callback(lambda f, job=job: self._on_waiter_done(job, f))
        return future

    def compile(self, params):
        """The compiled grammar, waiting for it (on this thread: the compile runs on a worker)."""
        return self.submit(params).result()

    def get(self, params):
        """The cached compiled grammar, None if the constraint is not (yet) compiled; raises its cached
        InvalidRequestError. Compiles nothing."""
        with self._lock:
            entry = self._cache.get(constraint_key(params))
        if entry is None:
            return None
        if entry.error is not None:
            raise _copy(entry.error)
        return entry.value

    def ready(self, params) -> bool:
        """Whether the constraint's verdict is cached (``get`` answers without waiting)."""
        with self._lock:
            return constraint_key(params) in self._cache

    def _on_waiter_done(self, job: _Job, future: concurrent.futures.Future) -> None:
        if not future.cancelled():
            return
        with self._lock:
            if future in job.waiters:
                job.waiters.remove(future)
            if not job.waiters and not job.taken and self._jobs.get(job.key) is job:
                del self._jobs[job.key]         # nobody waits and no worker has it: never compiled
                self._queue.remove(job)
                self.cancelled += 1

    # ---------------------------------------------------------------- workers
    def _start_threads(self) -> None:
        """(under the lock) the worker pool and the watchdog, on first use."""
        while len(self._threads) - self._abandoned < self.workers:
            self._threads.append(self._spawn())
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch_deadlines, name=f"{WORKER_PREFIX}-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _spawn(self) -> threading.Thread:
        """A worker thread with the large stack; where the system will not map that much (strict memory
        overcommit), half as much, down to what the default limits need."""
        name = f"{WORKER_PREFIX}-{next(self._names)}"
        with _stack_size_lock:
            previous = threading.stack_size()
            try:
                while True:
                    threading.stack_size(self.stack_bytes)
                    thread = threading.Thread(target=self._work_loop, name=name, daemon=True)
                    try:
                        thread.start()
                        return thread
                    except RuntimeError:
                        if self.stack_bytes // 2 < MIN_FALLBACK_STACK_BYTES:
                            raise
                        self.stack_bytes //= 2
                        logger.warning("could not start a grammar worker thread with its stack; trying %d MiB "
                                       "(deep grammar chains near the limits may overflow it)",
                                       self.stack_bytes >> 20)
            finally:
                threading.stack_size(previous)

    def _work_loop(self) -> None:
        name = threading.current_thread().name
        _lower_priority()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.taken = True
            try:
                if self._prepare is not None:
                    self._prepare()
            except Exception as e:      # the tokenizer llguidance cannot read: every constraint's answer
                self._finish(job, None, e if isinstance(e, InvalidRequestError) else InvalidRequestError(
                    f"structured outputs are not available: {e}", param="structured_outputs"))
                continue
            with self._lock:
                job.deadline = time.monotonic() + self.limits.compile_timeout_s
                self._running.add(job)
                self.compilations += 1
                self.compile_threads[name] += 1
                self._watch.notify()
            value, error = None, None
            try:
                check_constraint(job.params, self.limits, job.key[1])
                value = self._compile_fn(job.params)
            except InvalidRequestError as e:
                error = e
            except Exception as e:      # an llguidance API error: the constraint's, not the server's
                logger.exception("compiling a %s failed", job.params.kind)
                error = InvalidRequestError(f"the {NOUN_OF_KIND[job.params.kind]} could not be compiled: {e}",
                                            param=PARAM_OF_KIND[job.params.kind])
            if self._finish(job, value, error):
                return

    def _finish(self, job: _Job, value, error) -> bool:
        """Cache a job's result and hand it to its askers; True when this worker was replaced (it exits)."""
        entry = self._entry(job.key, value, error)
        with self._lock:
            self._running.discard(job)
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            evicted = self._store(job.key, entry)
            waiters, job.waiters = job.waiters, []
            if job.replaced:
                self._abandoned -= 1
                self._threads.remove(threading.current_thread())
            trim = self._freed_since_trim >= TRIM_AFTER_BYTES
            if trim:
                self._freed_since_trim = 0
        result = _Entry(value if self.retain else None, error, 0)
        for future in waiters:
            _resolve(future, result)
        del evicted                     # the dropped grammars go here, outside the lock
        if trim:
            release_free_heap()
        return job.replaced

    def _entry(self, key: tuple, value, error: InvalidRequestError | None) -> _Entry:
        """A cache entry and its bytes: the compiled grammar's (a verdict's is small) and its key's text."""
        kept = value if self.retain and error is None else None
        return _Entry(kept, error, len(key[1]) + (kept.nbytes if kept is not None else _VERDICT_BYTES))

    def _store(self, key, entry: _Entry) -> list[_Entry]:
        """(under the lock) cache an entry, evicting the least recently used past the byte budget; an entry
        larger than the whole budget is not kept. Returns what it dropped."""
        dropped = []
        old = self._cache.pop(key, None)
        if old is not None:
            self.cache_bytes -= old.nbytes
            dropped.append(old)
        if entry.nbytes <= self.limits.grammar_cache_bytes:
            self._cache[key] = entry
            self.cache_bytes += entry.nbytes
        while self.cache_bytes > self.limits.grammar_cache_bytes:
            _, old = self._cache.popitem(last=False)
            self.cache_bytes -= old.nbytes
            self.evictions += 1
            dropped.append(old)
        self._freed_since_trim += sum(d.nbytes for d in dropped if d.value is not None)
        return dropped

    def _watch_deadlines(self) -> None:
        """Fail the askers of each compile past its deadline, and replace its worker."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [j for j in self._running if not j.timed_out and j.deadline <= now]
                pending = [j.deadline for j in self._running if not j.timed_out]
                failed, dropped = [], []
                for job in expired:
                    job.timed_out = True
                    self.timeouts += 1
                    kind = job.params.kind
                    error = over_limit(f"the {NOUN_OF_KIND[kind]}'s compile time in seconds",
                                       f"more than {self.limits.compile_timeout_s:g}", "compile_timeout_s",
                                       self.limits, PARAM_OF_KIND[kind])
                    if self._jobs.get(job.key) is job:
                        del self._jobs[job.key]
                    dropped += self._store(job.key, self._entry(job.key, None, error))
                    failed.append((job, job.waiters, error))
                    job.waiters = []
                    if self._abandoned < self.workers:
                        job.replaced = True
                        self._abandoned += 1
                        self._threads.append(self._spawn())
                if not expired:
                    self._watch.wait(max(min(pending) - now, 0.0) if pending else None)
            del dropped
            for job, waiters, error in failed:
                logger.warning("compiling a %s ran past compile_timeout_s=%gs; its requests are refused: %r",
                               NOUN_OF_KIND[job.params.kind], self.limits.compile_timeout_s, excerpt(job.key[1]))
                for future in waiters:
                    _resolve(future, _Entry(None, error, 0))

    # ---------------------------------------------------------------- the rest
    def stats(self) -> dict:
        with self._lock:
            return {"compilations": self.compilations, "compile_threads": dict(self.compile_threads),
                    "cache_hits": self.cache_hits, "cache_entries": len(self._cache),
                    "cache_bytes": self.cache_bytes, "evictions": self.evictions, "timeouts": self.timeouts,
                    "cancelled": self.cancelled, "queued": len(self._queue), "running": len(self._running)}

    def close(self) -> None:
        """Stop the workers: the askers of queued compiles see their futures cancelled; a compile in flight
        finishes on its own and its askers get its result."""
        with self._lock:
            self._closed = True
            queued = [f for job in self._queue for f in job.waiters]
            for job in self._queue:
                self._jobs.pop(job.key, None)
            self._queue.clear()
            self._work.notify_all()
            self._watch.notify_all()
        for future in queued:
            future.cancel()


def _lower_priority() -> None:
    """Give the calling worker thread a lower CPU priority (Linux: a thread's own nice value), so that a long
    compile yields the cores to the event loop and the engine's step loop when they are short."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except (AttributeError, OSError):     # not Linux, or not allowed: the default priority
        pass


def _copy(error: InvalidRequestError) -> InvalidRequestError:
    """A fresh exception per asker (one raised from several threads would share its traceback)."""
    return InvalidRequestError(error.message, error.param)


def _resolve(future: concurrent.futures.Future, entry: _Entry) -> None:
    try:
        if entry.error is not None:
            future.set_exception(_copy(entry.error))
        else:
            future.set_result(entry.value)
    except concurrent.futures.InvalidStateError:     # the asker cancelled meanwhile
        pass
