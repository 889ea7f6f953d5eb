"""How the front end (``llm_engine.LLMEngine``) reaches its engine core: in this process (``InprocClient``)
or in its own (``MPClient``), behind the same calls:

    add_requests(front-end Requests)   abort_requests(ids)   get_outputs(timeout) -> EngineCoreOutputs
    embed(...)   wait_compiled(timeout)   stats()   is_alive()   shutdown()

plus ``facts`` (the loaded engine's ``EngineFacts``) and ``structured_output`` (the manager the front end
validates constraints with: in this process the core's own, whose compiled grammars the core then reuses).

``MPClient`` starts the core process (``jaxserve.engine.core_process``) and holds its sockets (PUSH requests
to it, PULL its outputs; msgpack over ZMQ ipc). ``add_requests`` / ``abort_requests`` may be called from any
thread (the request socket has a lock); one thread at a time reads the output socket (``get_outputs``, or
``embed`` waiting for its answer when no other thread reads). If the core process dies, a reader gets
EngineDeadError within ``DEATH_CHECK_S``.
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
from collections import deque

import msgspec

from jaxserve.engine import messages as m
from jaxserve.engine.core import EngineCore, EngineFacts
from jaxserve.engine.structured_output import StructuredOutputManager
from jaxserve.errors import EngineDeadError
from jaxserve.utils import startup_imports, startup_timeline

logger = logging.getLogger(__name__)


def _lora_fields(lora) -> tuple[str, int, str] | None:
    """A LoRARequest as the core message carries it."""
    return None if lora is None else (lora.lora_name, lora.lora_int_id, lora.lora_path)


DEATH_CHECK_S = 0.2          # how often a waiting reader checks that the core process is alive


class InprocClient:
    """The engine core in this process: each call is the core's, on the caller's thread."""

    multiprocess = False

    def __init__(self, config, *, progress: bool = True):
        self.core = EngineCore(config, progress=progress)
        self.facts: EngineFacts = self.core.facts()
        self.structured_output = self.core.structured_output
        self.last_output_time = time.monotonic()

    def add_requests(self, reqs) -> None:
        """Queue them all, or (one raised) none."""
        added = []
        try:
            for req in reqs:
                self.core.add_request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                      req.arrival_time, req.sampling_seed, priority=req.priority,
                                      cache_salt=req.cache_salt, mm_features=req.mm_features,
                                      lora_request=req.lora_request)
                added.append(req.request_id)
        except BaseException:
            self.core.abort_requests(added)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_outputs(self, timeout_s: float | None = None) -> list[m.EngineCoreOutput]:
        """One core step's outputs."""
        outputs = self.core.step()
        self.last_output_time = time.monotonic()
        return outputs

    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None):
        return self.core.embedder.embed(prompt_token_ids_list, truncate_prompt_tokens=truncate_prompt_tokens,
                                        dimensions=dimensions)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return self.core.wait_compiled(timeout)

    def stats(self) -> dict:
        return self.core.stats()

    def is_alive(self) -> bool:
        return True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.core.shutdown()


class MPClient:
    """The engine core process and its two sockets."""

    multiprocess = True
    core = None                     # (it lives in the other process)

    def __init__(self, config, *, progress: bool = True, startup_timeout_s: float | None = None,
                 env: dict[str, str] | None = None, remote=None):
        """``env``: variables the core process gets beside this one's (a data-parallel replica's devices).
        ``remote``: a core placed elsewhere that bound its own sockets (``executor.ray_replicas.RayCoreProcess``:
        a data-parallel replica on a Ray cluster): connect to them and start it, instead of a process here."""
        import subprocess
        import sys

        import zmq

        self._ctx = zmq.Context(io_threads=1)
        self._requests = self._ctx.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(m.FromCore)
        self.dead_reason: str | None = None
        t0 = time.perf_counter()
        if remote is not None:
            from jaxserve.engine.core_process import serve_engine_core
            self._dir = None
            self.input_address, self.output_address = remote.input_address, remote.output_address
            self._requests.connect(self.input_address)
            self._outputs.connect(self.output_address)
            self.process = remote.start(serve_engine_core, config, progress)
        else:
            self._dir = tempfile.mkdtemp(prefix="jaxserve-core-")
            self.input_address = f"ipc://{os.path.join(self._dir, 'in')}"
            self.output_address = f"ipc://{os.path.join(self._dir, 'out')}"
            self._requests.bind(self.input_address)
            self._outputs.bind(self.output_address)
            # a fresh interpreter (not multiprocessing's spawn, which re-imports the caller's __main__: a script
            # without a main guard would start a second engine); the config travels as a pickle file
            config_path = os.path.join(self._dir, "config.pickle")
            with open(config_path, "wb") as f:
                pickle.dump((config, progress), f)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jaxserve.engine.core_process", config_path, self.input_address,
                 self.output_address], env=None if env is None else {**os.environ, **env})
        # unpickling the core's tokenizer imports its library: import it now, while the core loads
        startup_imports.start_tokenizer_imports()
        facts = self._wait_ready(startup_timeout_s)
        startup_timeline.add_from_another_process(facts.startup_phases)
        self._start_reading(facts)
        core_s = facts.startup_seconds if facts.startup_seconds is not None else sum(
            seconds for _, seconds, detail in facts.startup_phases if not startup_timeline.is_overlapped(detail))
        startup_timeline.record("engine-core hand-shake", max(0.0, time.perf_counter() - t0 - core_s))

    def _start_reading(self, facts: EngineFacts) -> None:
        """The front end's side of a ready core: its facts, the manager the front end validates constraints
        with (it keeps verdicts only: the core compiles its own matchers), and the state of reading its
        outputs."""
        self.facts = facts
        self.structured_output = StructuredOutputManager(
            facts.tokenizer, facts.model_config.vocab_size, facts.eos_token_ids,
            disable_any_whitespace=facts.config.structured_outputs_config.disable_any_whitespace,
            disable_additional_properties=facts.config.structured_outputs_config.disable_additional_properties,
            limits=facts.config.structured_outputs_config, retain=False)
        self.structured_output.unsupported_reason = facts.structured_unsupported_reason
        self._read_lock = threading.Lock()          # one reader of the output socket at a time
        self._ready: deque[m.EngineCoreOutputs] = deque()     # read, not handed out yet
        self._stats: dict = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._embed_ids = itertools.count()
        self._embed_results: dict[int, m.EmbedResult] = {}
        self._embed_cv = threading.Condition()
        self._probe_ids = itertools.count()
        self.last_output_time = time.monotonic()

    def _wait_ready(self, timeout_s: float | None) -> EngineFacts:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                msg = self.recv(DEATH_CHECK_S)
            except EngineDeadError:
                self.close()
                raise
            if isinstance(msg, m.CoreReady):
                startup_imports.wait_tokenizer_imports()      # the facts' tokenizer needs that library
                return pickle.loads(msg.facts)
            if msg is not None:
                raise RuntimeError(f"the engine core sent {type(msg).__name__} before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the engine core was not ready after {timeout_s} s")

    # ---------------------------------------------------------------- requests
    def add_requests(self, reqs) -> None:
        """Send validated front-end Requests in one message: the core queues them all before its next step."""
        msgs = []
        for req in reqs:
            features, buffers = m.dump_features(req.mm_features) if req.mm_features else (None, None)
            msgs.append(m.EngineCoreRequest(req.request_id, req.prompt_token_ids, pickle.dumps(req.sampling_params),
                                            req.arrival_time, req.sampling_seed, req.priority, req.cache_salt,
                                            features, _lora_fields(req.lora_request), buffers))
        self.send(msgs[0] if len(msgs) == 1 else m.AddRequests(msgs))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self.send(m.AbortRequests(request_ids))

    # ---------------------------------------------------------------- outputs
    def get_outputs(self, timeout_s: float | None = None) -> list[m.EngineCoreOutput]:
        """The outputs of the core's next step that has some (waits for them; [] after ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready:
            wait = DEATH_CHECK_S if deadline is None else min(DEATH_CHECK_S, max(0.0, deadline - time.monotonic()))
            with self._read_lock:
                self._read(wait)
            if not self._ready and deadline is not None and time.monotonic() >= deadline:
                return []
        return self._ready.popleft().outputs

    @property
    def output_socket(self):
        """The socket the core's outputs arrive on (to poll several cores' at once: ``dp_client``)."""
        return self._outputs

    def read_available(self) -> bool:
        """Read every message the core has sent, without waiting (False, reading nothing: another thread reads
        now). Raises EngineDeadError (or the core's load error) if the core died."""
        if not self._read_lock.acquire(blocking=False):
            return False
        try:
            while self._read(0) is not None:
                pass
        finally:
            self._read_lock.release()
        return True

    def take_outputs(self) -> list[m.EngineCoreOutput]:
        """The outputs of every step read and not handed out yet (``get_outputs`` without waiting)."""
        outputs = []
        while self._ready:
            outputs += self._ready.popleft().outputs
        return outputs

    def _read(self, timeout_s: float):
        """Read one message (or none after ``timeout_s``): a step's outputs are kept for ``get_outputs`` (the
        core's stats they carry taken now), an embedding result goes to its waiting caller. Returns it."""
        msg = self.recv(timeout_s)
        if isinstance(msg, m.EngineCoreOutputs):
            self.last_output_time = time.monotonic()
            if msg.stats is not None:
                self._stats = msg.stats
            if msg.outputs:
                self._ready.append(msg)
        elif isinstance(msg, m.EmbedResult):
            with self._embed_cv:
                self._embed_results[msg.call_id] = msg
                self._embed_cv.notify_all()
        return msg

    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None):
        """Embeddings computed in the core (blocking; from any thread)."""
        call_id = next(self._embed_ids)
        self.send(m.EmbedCall(call_id, [list(p) for p in prompt_token_ids_list], truncate_prompt_tokens,
                              dimensions))
        while True:
            with self._embed_cv:
                result = self._embed_results.pop(call_id, None)
            if result is not None:
                if result.error is not None:
                    raise pickle.loads(result.error)
                return pickle.loads(result.embeddings)
            if not self.is_alive():
                raise EngineDeadError(self.dead_reason or "the engine core process is gone")
            if self._read_lock.acquire(blocking=False):     # nobody else reads: read here
                try:
                    self._read(DEATH_CHECK_S)
                finally:
                    self._read_lock.release()
            else:
                with self._embed_cv:
                    if call_id not in self._embed_results:
                        self._embed_cv.wait(DEATH_CHECK_S)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Until the core's background compiles are done (False after ``timeout`` seconds). The core reports
        its pending count with each step, so this runs one-token probe requests (which the front end never
        sees) until it reads 0. Call it while no other thread reads the outputs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        probe = pickle.dumps(_probe_params())
        while self._stats.get("step_variants_pending", 1):
            if deadline is not None and time.monotonic() > deadline:
                return False
            rid = f"compile-probe-{next(self._probe_ids)}"
            self.send(m.EngineCoreRequest(rid, [0], probe, time.time(), 0))
            with self._read_lock:
                while not _finishes(self._read(DEATH_CHECK_S), rid):
                    pass
            time.sleep(0.2)
        return True

    def stats(self) -> dict:
        return dict(self._stats)

    # ---------------------------------------------------------------- the process and its sockets
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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.close(timeout_s)

    def request_shutdown(self) -> None:
        """Ask the core to stop (without waiting: a core already gone has no socket to take it)."""
        import zmq
        try:
            with self._send_lock:
                self._requests.send(self._encoder.encode(m.Shutdown()), zmq.NOBLOCK)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait up to ``timeout_s``, then kill it; close the sockets."""
        if self._ctx.closed:
            return
        if self.process.poll() is None:
            self.request_shutdown()
            if not self._join(timeout_s):
                self.process.kill()
                self._join(5)
        self._requests.close(0)
        self._outputs.close(0)
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _probe_params():
    from jaxserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=1, temperature=0.0)


def _finishes(msg, request_id: str) -> bool:
    """Whether ``msg`` is a step's outputs that finish ``request_id``."""
    return isinstance(msg, m.EngineCoreOutputs) and any(
        o.request_id == request_id and o.finish_status for o in msg.outputs)


def data_parallel_size(config) -> int:
    return getattr(getattr(config, "parallel", None), "data_parallel_size", 1)


def use_multiprocess(explicit: bool | None, default: bool, config=None) -> bool:
    """Whether a front end runs the engine core in its own process: ``explicit`` if given, else
    JAXSERVE_ENABLE_MULTIPROCESSING if set, else ``default``; never for an engine spread over several JAX
    processes (``config.parallel``: those processes follow the one that schedules); always for data-parallel
    replicas (``dp_client``: a core process each)."""
    from jaxserve import envs
    if data_parallel_size(config) > 1:
        if explicit is False or (explicit is None and envs.JAXSERVE_ENABLE_MULTIPROCESSING is False):
            raise ValueError("data-parallel replicas each run in their own process: drop multiprocess=False / "
                             "JAXSERVE_ENABLE_MULTIPROCESSING=0, or use --data-parallel-size 1")
        return True
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
