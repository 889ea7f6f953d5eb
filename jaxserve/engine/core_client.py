"""The front end of a split engine: the engine core in its own process (``jaxserve.engine.core``), and here
everything that needs text.

``EngineCoreClient`` starts the core process and holds the sockets (PUSH requests to it, PULL its outputs;
msgpack over ZMQ ipc). ``MultiprocessLLMEngine`` has the in-process ``LLMEngine``'s interface for the offline
``LLM`` and the async front: it validates and builds requests (``RequestBuilder``, with the facts the core
sent), keeps each request's front-end state, and turns the core's per-step outputs into RequestOutputs
(``FrontendOutputProcessor``: detokenization, stop strings, logprob text). A stop string found here aborts the
request in the core.

Threads: ``enqueue`` / ``abort_request`` may be called from any thread (the request socket has a lock);
``step`` (the only reader of the output socket) from one thread at a time.

If the core process dies, ``step`` raises EngineDeadError within ``DEATH_CHECK_S``.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref

import msgspec
import numpy as np

from jaxserve.engine import messages as m
from jaxserve.engine.llm_engine import EngineFacts, RequestBuilder
from jaxserve.engine.output_processor import FrontendOutputProcessor
from jaxserve.engine.request import Request
from jaxserve.engine.structured_output import StructuredOutputManager
from jaxserve.errors import EngineDeadError, InvalidRequestError
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

DEATH_CHECK_S = 0.2          # how often a waiting reader checks that the core process is alive


class EngineCoreClient:
    """The engine core process and its two sockets."""

    def __init__(self, config, *, progress: bool = True, startup_timeout_s: float | None = None):
        import subprocess
        import sys

        import zmq

        self._dir = tempfile.mkdtemp(prefix="jaxserve-core-")
        self.input_address = f"ipc://{os.path.join(self._dir, 'in')}"
        self.output_address = f"ipc://{os.path.join(self._dir, 'out')}"
        self._ctx = zmq.Context(io_threads=1)
        self._requests = self._ctx.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.bind(self.input_address)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(self.output_address)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(m.FromCore)
        self.dead_reason: str | None = None
        # a fresh interpreter (not multiprocessing's spawn, which re-imports the caller's __main__: a script
        # without a main guard would start a second engine); the config travels as a pickle file
        config_path = os.path.join(self._dir, "config.pickle")
        with open(config_path, "wb") as f:
            pickle.dump((config, progress), f)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.engine.core", config_path, self.input_address, self.output_address])
        self.facts: EngineFacts = self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float | None) -> EngineFacts:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                msg = self.recv(DEATH_CHECK_S)
            except EngineDeadError:
                self.close()
                raise
            if isinstance(msg, m.CoreReady):
                return pickle.loads(msg.facts)
            if msg is not None:
                raise RuntimeError(f"the engine core sent {type(msg).__name__} before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the engine core was not ready after {timeout_s} s")

    def send(self, msg) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            self._requests.send(data, copy=False)

    def recv(self, timeout_s: float):
        """The core's next message, or None after ``timeout_s``; raises EngineDeadError if the core died."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._outputs.poll(int(timeout_s * 1000)):
            msg = self._decoder.decode(self._outputs.recv(copy=False).buffer)
            if isinstance(msg, m.CoreFailed):
                self.dead_reason = f"the engine core failed: {msg.error}"
                self._join(5)
                exc = pickle.loads(msg.exception) if msg.exception is not None else None
                if isinstance(exc, Exception) and not isinstance(exc, RuntimeError):
                    raise exc           # a load error the caller knows how to report (ModelLoadError, ...)
                raise EngineDeadError(self.dead_reason)
            return msg
        code = self.process.poll()
        if code is not None:
            self.dead_reason = f"the engine core process exited (exit code {code})"
            raise EngineDeadError(self.dead_reason)
        return None

    def is_alive(self) -> bool:
        return self.dead_reason is None and self.process.poll() is None

    def _join(self, timeout_s: float) -> bool:
        import subprocess
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait up to ``timeout_s``, then kill it; close the sockets."""
        if self._ctx.closed:
            return
        if self.process.poll() is None:
            try:
                with self._send_lock:
                    self._requests.send(self._encoder.encode(m.Shutdown()))
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
            if not self._join(timeout_s):
                self.process.kill()
                self._join(5)
        self._requests.close(0)
        self._outputs.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class _EmbedderProxy:
    def __init__(self, engine: "MultiprocessLLMEngine"):
        self._engine = engine

    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None):
        return self._engine.embed(prompt_token_ids_list, truncate_prompt_tokens=truncate_prompt_tokens,
                                  dimensions=dimensions)


class MultiprocessLLMEngine(RequestBuilder):
    """The front end of a split engine, with LLMEngine's interface (``step`` returns RequestOutputs)."""

    multiprocess = True

    def __init__(self, config, *, progress: bool = True):
        self.client = EngineCoreClient(config, progress=progress)
        weakref.finalize(self, self.client.close)      # an LLM dropped without shutdown() stops its core
        facts = self._facts = self.client.facts
        self.config = facts.config
        self.tokenizer = facts.tokenizer
        self.model_config = facts.model_config
        self.max_model_len = facts.max_model_len
        self.eos_token_ids = facts.eos_token_ids
        self.chat_template = facts.chat_template
        self.is_embedding = facts.is_embedding
        self.load_seconds, self.warmup_seconds = facts.load_seconds, facts.warmup_seconds
        self._multi_process = facts.multi_process
        # validates and compiles constraints for the front end (the core compiles its own matchers)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
            disable_any_whitespace=self.config.structured_outputs_config.disable_any_whitespace)
        self.structured_output.unsupported_reason = facts.structured_unsupported_reason
        self.output_processor = FrontendOutputProcessor(self.tokenizer)
        self._seed_rng = np.random.default_rng(self.config.seed)
        self._ids = itertools.count()
        self._stats: dict = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._embed_ids = itertools.count()
        self._embed_results: dict[int, m.EmbedResult] = {}
        self._embed_cv = threading.Condition()
        self._reader_thread: threading.Thread | None = None     # set by a front that reads in a thread
        self.last_output_time = time.monotonic()

    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def embedder(self):
        return _EmbedderProxy(self) if self.is_embedding else None

    # ---------------------------------------------------------------- requests
    def enqueue(self, req: Request) -> None:
        """Register the request's front-end state and send it to the core (any thread)."""
        self.enqueue_many([req])

    def enqueue_many(self, reqs: list[Request]) -> None:
        """Register several requests and send them in one message: the core queues them all before its
        next step."""
        procs = self.output_processor
        for i, req in enumerate(reqs):
            if req.request_id in procs.requests or any(r.request_id == req.request_id for r in reqs[:i]):
                raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        msgs = [m.EngineCoreRequest(req.request_id, req.prompt_token_ids, pickle.dumps(req.sampling_params),
                                    req.arrival_time, req.sampling_seed) for req in reqs]
        for req in reqs:
            procs.add_request(req)
        try:
            self.client.send(msgs[0] if len(msgs) == 1 else m.AddRequests(msgs))
        except BaseException:
            for req in reqs:
                procs.remove(req.request_id)
            raise

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
                    arrival_time: float | None = None) -> None:
        self.enqueue(self.make_request(request_id, prompt_token_ids, params, prompt, arrival_time))

    def abort_request(self, request_ids) -> None:
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in request_ids:
            self.output_processor.remove(rid)
        if request_ids and self.client.dead_reason is None:
            self.client.send(m.AbortRequests(request_ids))

    def request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ---------------------------------------------------------------- outputs
    def step(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """The RequestOutputs of the core's next step (waits for it; [] after ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = DEATH_CHECK_S if deadline is None else min(DEATH_CHECK_S, max(0.0, deadline - time.monotonic()))
            msg = self.client.recv(wait)
            if isinstance(msg, m.EngineCoreOutputs):
                self.last_output_time = time.monotonic()
                if msg.stats is not None:
                    self._stats = msg.stats
                outputs, stopped_here = self.output_processor.process_outputs(msg.outputs)
                if stopped_here:
                    self.client.send(m.AbortRequests(stopped_here))
                return outputs
            if isinstance(msg, m.EmbedResult):
                with self._embed_cv:
                    self._embed_results[msg.call_id] = msg
                    self._embed_cv.notify_all()
                continue
            if msg is None and deadline is not None and time.monotonic() >= deadline:
                return []

    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None):
        """Embeddings computed in the core (blocking; from any thread when another thread runs ``step``)."""
        call_id = next(self._embed_ids)
        self.client.send(m.EmbedCall(call_id, [list(p) for p in prompt_token_ids_list], truncate_prompt_tokens,
                                     dimensions))
        while True:
            with self._embed_cv:
                result = self._embed_results.pop(call_id, None)
                if result is None and self._reader_thread is not None:
                    self._embed_cv.wait(DEATH_CHECK_S)
                    result = self._embed_results.pop(call_id, None)
            if result is not None:
                if result.error is not None:
                    raise pickle.loads(result.error)
                return pickle.loads(result.embeddings)
            if not self.client.is_alive():
                raise EngineDeadError(self.client.dead_reason or "the engine core process is gone")
            if self._reader_thread is None:
                self.step(timeout_s=DEATH_CHECK_S)

    def stats(self) -> dict:
        return dict(self._stats)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.client.close(timeout_s)


def use_multiprocess(explicit: bool | None, default: bool, config=None) -> bool:
    """Whether a front end runs the engine core in its own process: ``explicit`` if given, else
    JAXSERVE_ENABLE_MULTIPROCESSING if set, else ``default``; never for an engine spread over several JAX
    processes (``config.parallel``: those processes follow the one that schedules)."""
    from jaxserve import envs
    if explicit is None:
        env = envs.JAXSERVE_ENABLE_MULTIPROCESSING
        wanted = default if env is None else env
    else:
        wanted = explicit
    par = getattr(config, "parallel", None)
    if wanted and par is not None and (par.num_processes > 1 or par.distributed_coordinator
                                       or par.distributed_executor_backend != "uni"):
        if explicit:
            raise ValueError("the engine core runs in its own process only when the model is in one JAX process "
                             "(not with --num-processes / --distributed-executor-backend mp)")
        logger.info("the engine spans several JAX processes: its core stays in this process")
        return False
    return wanted
