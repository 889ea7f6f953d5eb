"""The async front: per-request output streams fed by a background thread.

The server (and anything async) calls ``generate`` / ``abort`` / ``embed``. With the engine core in this
process (``multiprocess`` off), the loop thread owns the ``LLMEngine`` and is the only thread that touches
it, so no locks guard engine state: requests and aborts cross over through thread-safe queues. With the core
in its own process, requests and aborts go straight to the core's socket from the caller, and the thread
reads the core's per-step outputs, renders them and hands them out. Either way
outputs come back with ``call_soon_threadsafe``, one call per consumer loop per step.
A request is validated and admitted (``check_admission``: the one place --max-waiting-requests is read)
on the caller's side, before it crosses over, so the caller gets the error.

If the engine dies (the loop raises, or the core process exits), every waiting request gets an
EngineDeadError, ``is_healthy`` turns False, and ``on_dead`` (if set) is called once, from the thread. If one
of several data-parallel replicas dies, only its requests get the error (``ReplicaLostError``) and
``is_healthy`` turns False; the others serve on.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from typing import AsyncIterator

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import EngineClient, LLMEngine
from jaxserve.errors import EngineDeadError, InvalidRequestError, QueueFullError, ReplicaLostError
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A step that takes longer than this while requests wait means the loop is stuck (GET /health → 503).
STUCK_AFTER_S = 60.0


class _Stream:
    """One request's outputs on their way to its consumer: a list the engine thread fills (through the
    consumer loop's ``call_soon_threadsafe``) and a future the consumer waits on when it is empty. Lighter
    than an asyncio.Queue (no put/get waiter queues, no per-item future): a step hands each stream its
    output with one append and, if its consumer waits, one ``set_result``."""
    __slots__ = ("loop", "items", "waiter", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.finished = False

    def put_nowait(self, item) -> None:
        """On the consumer's loop."""
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def put(self, item) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self.put_nowait, item)
        except RuntimeError:       # the consumer's loop is closed: nobody is listening any more
            pass

    async def get(self):
        while not self.items:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.items.popleft()


def _put_all(items) -> None:
    for stream, item in items:
        stream.put_nowait(item)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True, engine: EngineClient | None = None,
                 multiprocess: bool | None = None):
        from jaxserve.engine.core_client import use_multiprocess
        self.multiprocess = (getattr(engine, "multiprocess", False) if engine is not None
                             else use_multiprocess(multiprocess, default=False, config=config))
        self.engine = engine if engine is not None else LLMEngine(config, progress=progress,
                                                                  multiprocess=self.multiprocess)
        self.config = self.engine.config
        self.on_dead = None                   # called once (from the engine thread) when the engine dies
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._dead: BaseException | None = None
        self._busy_since: float | None = None
        self._stats = self.engine.stats()
        self._pending = 0                     # submitted, not yet in the scheduler (both threads change it)
        self._pending_lock = threading.Lock()
        # workers Ray placed (executor.ray_workers): a lost one fails the requests at once, not a stuck step
        workers = getattr(getattr(getattr(self.engine, "core", None), "executor", None), "workers", None)
        if hasattr(workers, "on_worker_lost"):
            workers.on_worker_lost = lambda why: self._die(RuntimeError(why), EngineDeadError(why))
        self._thread = threading.Thread(target=self._read_core if self.multiprocess else self._loop,
                                        name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- facts the server needs
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def structured_output(self):
        """The engine's StructuredOutputManager: the server compiles constraints with it off the loop."""
        return self.engine.structured_output

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def chat_template(self) -> str | None:
        return self.engine.chat_template

    def facts(self):
        """The loaded engine's EngineFacts (model, dtype, load and warm-up seconds)."""
        return self.engine.facts()

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def stats(self) -> dict:
        return dict(self._stats)

    def num_waiting(self) -> int:
        if self.multiprocess:   # sent to the core but not in its stats yet count as waiting
            ahead = self.engine.num_unfinished_requests() - self._stats.get("num_running", 0)
            return max(self._stats.get("num_waiting", 0), ahead)
        return self._stats.get("num_waiting", 0) + self._pending

    def check_admission(self, num_requests: int = 1) -> None:
        """Raise unless ``num_requests`` more requests fit under --max-waiting-requests: InvalidRequestError
        (HTTP 400) if they never can (more than max_num_seqs + max_waiting_requests at once), QueueFullError
        (429, retry later) if they cannot now. Requests the next step will schedule (up to the free seats of
        max_num_seqs) count as running, not waiting."""
        sched = self.config.scheduler
        limit = sched.max_waiting_requests
        if limit is None:
            return
        max_seqs = sched.max_num_seqs * self.config.parallel.data_parallel_size     # (each replica's seats)
        if num_requests > max_seqs + limit:
            raise InvalidRequestError(
                f"the request needs {num_requests} sequences (prompts x n), more than this server ever holds: "
                f"{max_seqs} running (--max-num-seqs) + {limit} waiting (--max-waiting-requests)", param="n")
        free_seats = max(0, max_seqs - self._stats.get("num_running", 0))
        waiting = self.num_waiting() + num_requests - free_seats
        if waiting > limit:
            raise QueueFullError(f"{self.num_waiting()} requests are waiting (--max-waiting-requests {limit}); "
                                 "retry later")

    def is_healthy(self) -> bool:
        if self._dead is not None or not self._thread.is_alive():
            return False
        if self.multiprocess:
            eng = self.engine
            return eng.is_core_alive() and (not eng.has_unfinished_requests()
                                            or time.monotonic() - eng.last_output_time < STUCK_AFTER_S)
        busy = self._busy_since
        return busy is None or time.monotonic() - busy < STUCK_AFTER_S

    # ---------------------------------------------------------------- requests
    @property
    def images(self):
        """The front end's image handling (``llm_engine.MultiModalInputs``)."""
        return self.engine.images

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str,
                       prompt: str | None = None, *, priority: int = 0, cache_salt: str | None = None,
                       mm_features: list | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine died: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        # (never waits for a grammar here, on the event loop: the server awaited its verdict)
        req = self.engine.make_request(request_id, prompt_token_ids, sampling_params, prompt, time.time(),
                                       strict_length=True, priority=priority, cache_salt=cache_salt,
                                       wait_for_grammar=False, mm_features=mm_features, lora_request=lora_request)
        self.check_admission(1)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        if self.multiprocess:
            try:
                self.engine.add_requests([req])
            except BaseException:
                self._streams.pop(request_id, None)
                raise
        else:
            with self._pending_lock:
                self._pending += 1
            self._inbox.put(("add", req))
            self._wake.set()
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:          # the consumer went away (client disconnect, cancel): free it now
                self._abort(request_id)
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self.multiprocess:
            if self._dead is None:
                try:
                    self.engine.abort_request(request_id)
                except EngineDeadError:
                    pass
            return
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def embed(self, prompt_token_ids_list: list[list[int]], **kw):
        if not self.engine.is_embedding:
            raise InvalidRequestError("the loaded model does not support embeddings", param="model")
        return await asyncio.to_thread(self.engine.embed, prompt_token_ids_list, **kw)

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish up to ``drain_timeout``, then stop the loop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ---------------------------------------------------------------- the loop thread
    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                req = msg[1]
                with self._pending_lock:
                    self._pending -= 1
                stream = self._streams.get(req.request_id)
                if stream is None:           # aborted before it was added
                    continue
                try:
                    eng.add_requests([req])
                except Exception as e:       # noqa: BLE001 - reported to that request only
                    stream.put(e)
            else:
                eng.abort_request(msg[1])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each consumer loop per step, not one per
        output (256 cross-thread calls a step took the GIL from the loop thread as often)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # that loop is closed: nobody is listening any more
                pass

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not eng.has_unfinished_requests():
                    self._stats = eng.stats()
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                self._busy_since = time.monotonic()
                outputs = eng.step()
                self._busy_since = None
                self._publish(outputs)
                self._stats = eng.stats()
        except BaseException as e:  # noqa: BLE001 - the loop is dead; tell every waiting request
            logger.exception("engine loop died")
            self._die(e, EngineDeadError(f"the engine loop died: {e!r}"))

    def _read_core(self) -> None:
        """The thread of an engine whose core runs in its own process: its outputs → the streams."""
        eng = self.engine
        try:
            while not self._stop.is_set():
                try:
                    outputs = eng.step(timeout_s=0.1)
                except ReplicaLostError as e:       # one data-parallel replica died: its requests fail now
                    for rid in e.request_ids:
                        stream = self._streams.get(rid)
                        if stream is not None:
                            stream.put(e)
                    continue
                if outputs:
                    self._publish(outputs)
                self._stats = eng.stats()
        except BaseException as e:  # noqa: BLE001 - the core is gone; tell every waiting request
            logger.error("the engine core died: %s", e)
            self._die(e, e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine core died: {e!r}"))

    def _die(self, cause: BaseException, error: EngineDeadError) -> None:
        self._dead = cause
        for stream in list(self._streams.values()):
            stream.put(error)
        if self.on_dead is not None:
            self.on_dead()
