"""The engine: requests in, ``step()`` = schedule → dispatch → process the previous step's outputs → outputs out.

Single-threaded. Used directly by the offline ``LLM`` class and, on a background thread, by the async front;
with ``core_outputs=True`` it is the engine core of a split engine (``jaxserve.engine.core``, its own process:
no text, compact per-step outputs), and ``core_client.MultiprocessLLMEngine`` is its front end.
The roles, in vLLM v1's shape: the engine boundary (``make_request``) validates a request once and builds its
``Request``, the one object holding its state; the scheduler picks each step's tokens and counts the tokens
a dispatched step will sample as placeholders; the runner dispatches steps; the output processor reads
their tokens and alone decides that a request is finished (and why), which the scheduler then frees.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from typing import Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.embedder import Embedder, is_embedding_model
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.structured_output import StructuredOutputManager
from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import RequestOutput
from jaxserve.runner.model_runner import ModelRunner, resolve_attention_backend
from jaxserve.sampling_params import SamplingParams, check_token_ids

logger = logging.getLogger(__name__)


DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"     # the embedded default model


def validate_prompt_length(prompt_token_ids: Sequence[int] | int, max_tokens: int | None,
                           max_model_len: int) -> None:
    """Reject a prompt that is empty or longer than max_model_len, or (when max_tokens is given) one that
    leaves no room for max_tokens new tokens, as vLLM's OpenAI server does. Pass max_tokens=None to only
    check the prompt (generation then stops at max_model_len, "length")."""
    n = prompt_token_ids if isinstance(prompt_token_ids, int) else len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty: send at least one token", param="prompt")
    if n > max_model_len:
        raise InvalidRequestError(f"prompt has {n} tokens, max_model_len is {max_model_len}", param="prompt")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens exceed "
            f"max_model_len {max_model_len}; lower max_tokens or shorten the prompt", param="max_tokens")


@dataclasses.dataclass(slots=True)
class _InFlight:
    """A dispatched step whose tokens are not read yet."""
    pending: object                               # runner.PendingStep
    sampled: list[tuple[Request, int]]            # (request, index of its first placeholder of this step)
    scored: list = dataclasses.field(default_factory=list)   # prompt_logprobs chunks scored after the step


@dataclasses.dataclass
class EngineFacts:
    """What a front end knows of a loaded engine: enough to validate requests and to (de)tokenize without
    the model (the engine core process sends it once, when it is ready)."""
    config: EngineConfig                  # resolved for the backend
    tokenizer: object
    model_config: object
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    is_embedding: bool
    multi_process: bool                   # the model spans several JAX processes
    structured_unsupported_reason: str | None
    model_source: str
    load_format: str
    dtype_name: str
    load_seconds: float
    warmup_seconds: float
    num_kv_blocks: int | None = None      # None: an embedding model (no KV cache)


class RequestBuilder:
    """The engine boundary, shared by the in-process engine and the front end of a split one: validate a
    request once and build its ``Request``. Needs ``config``, ``model_config``, ``max_model_len``,
    ``eos_token_ids``, ``is_embedding``, ``served_model_name``, ``structured_output``, ``_multi_process``
    and ``_seed_rng``."""

    @property
    def served_model_name(self) -> str:
        # vLLM's rule: the --served-model-name, else the model argument as given
        return self.config.served_model_name or self.config.model or DEFAULT_SERVED_NAME

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, *, strict_length: bool = True) -> None:
        """Reject what can never run, with a message a user can act on. ``strict_length``: prompt + max_tokens
        must fit max_model_len (the server's rule); off, generation just stops at max_model_len (offline)."""
        if self.is_embedding:
            raise InvalidRequestError(
                f"the loaded model ({self.served_model_name}) serves embeddings (/v1/embeddings, LLM.embed), "
                "not text generation", param="model")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (size {self.model_config.vocab_size})",
                param="prompt")
        validate_prompt_length(len(prompt_token_ids), params.max_tokens if strict_length else None,
                               self.max_model_len)
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(prompt_token_ids) > sched.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens, more than max_num_batched_tokens "
                f"{sched.max_num_batched_tokens} with chunked prefill off", param="prompt")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise InvalidRequestError(
                    f"{name}={k} is above the server's max_logprobs={self.config.max_logprobs}", param=name)
        if params.prompt_logprobs is not None and self._multi_process:
            # the prompt scorer is an extra computation process 0 alone would launch (the others only follow
            # steps), and the mesh's collectives would wait for them forever
            raise InvalidRequestError("prompt_logprobs is not available when the model is spread over several "
                                      "processes (--num-processes / --distributed-executor-backend mp)",
                                      param="prompt_logprobs")
        check_token_ids(params, self.model_config.vocab_size)              # logit_bias, allowed_token_ids
        if params.structured_outputs is not None:
            self.structured_output.compile(params.structured_outputs)    # cached; raises naming the problem

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prompt: str | None = None, arrival_time: float | None = None, *,
                     strict_length: bool = False) -> Request:
        """The engine's boundary: truncate the prompt as asked, validate (``validate``), and build the Request
        with its own copy of the parameters (which knows the model's eos ids: the sampler blocks them below
        min_tokens) and its sampling seed. Raises InvalidRequestError; queues nothing (``enqueue`` does)."""
        prompt_token_ids = list(prompt_token_ids)
        keep = params.truncate_prompt_tokens
        if keep == -1:                      # vLLM: -1 = keep up to max_model_len tokens (the last ones)
            keep = self.max_model_len
        if keep is not None and len(prompt_token_ids) > keep:
            prompt_token_ids = prompt_token_ids[-keep:]
        self.validate(prompt_token_ids, params, strict_length=strict_length)
        params = params.clone()
        params.update_from_generation_config({"eos_token_id": list(self.eos_token_ids)},
                                             self.eos_token_ids[0] if self.eos_token_ids else None)
        params.update_from_tokenizer(self.tokenizer)                   # bad_words as token sequences
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                      arrival_time=arrival_time or time.time(), prompt=prompt)
        req.sampling_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31 - 1))
        return req


class LLMEngine(RequestBuilder):
    """The in-process engine (front end and core in one), and the core of a split engine
    (``core_outputs=True``: no text; ``step`` returns EngineCoreOutputs, see output_processor)."""

    def __init__(self, config: EngineConfig, *, progress: bool = True, core_outputs: bool = False):
        import jax

        from jaxserve.models import load_model
        from jaxserve.runner import compile_cache

        from jaxserve.executor import launcher
        # --distributed-executor-backend mp: spawn the per-device workers and join jax.distributed before
        # anything below starts a JAX backend
        self._workers = launcher.maybe_start(config)
        compile_cache.enable(config.compilation_cache_dir)
        config = config.resolved(jax.default_backend())
        self.config = config
        t0 = time.perf_counter()
        mesh = None
        if config.parallel.tensor_parallel_size > 1:
            from jaxserve.parallel import collectives, enable_custom_all_reduce, make_mesh
            mesh = make_mesh(config.parallel.tensor_parallel_size)
            # every process, before the first trace: the row-parallel layers pick their all-reduce at trace time
            why_not = enable_custom_all_reduce(mesh, disable=config.parallel.disable_custom_all_reduce)
            self.custom_all_reduce = why_not is None
            fused = " (fused with the residual add and RMSNorm)" if collectives.fuses_norm() else ""
            logger.info("tensor parallelism %d: %s", config.parallel.tensor_parallel_size,
                     f"CUDA one-shot all-reduce for steps up to 1 MiB{fused}" if why_not is None
                     else f"XLA's all-reduce ({why_not})")
        else:
            self.custom_all_reduce = False
        self.mesh = mesh
        self.model = load_model(config.model, dtype=config.dtype, load_format=config.load_format,
                                max_model_len=config.max_model_len, mesh=mesh, quantization=config.quantization,
                                enable_expert_parallel=config.parallel.enable_expert_parallel)
        self.load_seconds = time.perf_counter() - t0
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        if config.tokenizer:                # --tokenizer: another HF tokenizer folder for this model
            from transformers import AutoTokenizer
            self.tokenizer = self.model.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.chat_template = config.chat_template or self.model.chat_template
        self.eos_token_ids = tuple(self.model_config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
            disable_any_whitespace=config.structured_outputs_config.disable_any_whitespace)
        self.core_outputs = core_outputs
        self.output_processor = OutputProcessor(self.tokenizer, self.structured_output, core_outputs=core_outputs)
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        # dispatched steps, oldest first; with async scheduling one stays on the device between step() calls
        self._in_flight: deque[_InFlight] = deque()
        self._lookahead = 1 if config.async_scheduling else 0
        self._scorer = None
        self._step_ms = 0.0                       # wall time inside step(), summed (host + device waits)
        self.warmup_seconds = 0.0
        self._multi_process = jax.process_count() > 1
        self.embedder = self.runner = self.scheduler = self.kv_manager = None
        t0 = time.perf_counter()
        if is_embedding_model(self.model, config.task):
            if jax.process_count() > 1:
                raise ValueError("embedding models run in a single process (no --num-processes / "
                                 "--distributed-executor-backend mp)")
            # an embedding engine: no KV cache, no scheduler; requests go straight to the bucketed Embedder
            self.embedder = Embedder(self.model, attn_backend=resolve_attention_backend(config.attention_backend),
                                     block_size=config.cache.block_size, max_length=config.max_model_len,
                                     model_name=config.served_model_name)
            self.max_model_len = self.embedder.max_length
            if not config.skip_warmup:
                self.embedder.warmup(progress=progress)
        else:
            self.max_model_len = self.model.max_model_len     # the loader checked it against the model
            self.runner = ModelRunner(self.model, config, self.max_model_len, mesh=mesh)
            self.kv_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                             config.cache.enable_prefix_caching, self.max_model_len)
            self.scheduler = Scheduler(config.scheduler, config.cache, self.kv_manager, self.max_model_len)
            if not config.skip_warmup:
                self.runner.warmup(progress=progress)
            if self._multi_process and jax.process_index() == 0:
                # the other processes run follow_runner: each step is sent to them before it launches
                from jaxserve.executor import BroadcastingRunner
                channel = self._workers.step_channel() if self._workers is not None else None
                self.runner = BroadcastingRunner(self.runner, channel)
                # the processes follow the steps process 0 sends, and a step carries no bitmask
                self.structured_output.unsupported_reason = (
                    "the model is spread over several processes (--num-processes / "
                    "--distributed-executor-backend mp); run it in one process (-tp over its local GPUs)")
                if self._workers is not None:
                    self._workers.set_release(self.runner.stop)
        self.warmup_seconds = time.perf_counter() - t0

    @property
    def is_embedding(self) -> bool:
        return self.embedder is not None

    def facts(self) -> EngineFacts:
        model = self.model
        return EngineFacts(
            config=self.config, tokenizer=self.tokenizer, model_config=self.model_config,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, chat_template=self.chat_template,
            is_embedding=self.is_embedding, multi_process=self._multi_process,
            structured_unsupported_reason=self.structured_output.unsupported_reason,
            model_source=str(getattr(model, "source", self.config.model)),
            load_format=str(getattr(model, "load_format", self.config.load_format)),
            dtype_name=str(getattr(model.dtype, "__name__", model.dtype)),
            load_seconds=self.load_seconds, warmup_seconds=self.warmup_seconds,
            num_kv_blocks=self.runner.num_blocks if self.runner is not None else None)

    # ---------------------------------------------------------------- requests
    def enqueue(self, req: Request) -> None:
        """Queue a Request from ``make_request`` (on the engine's thread). Raises InvalidRequestError if its id
        is in use."""
        if self.scheduler.get_request(req.request_id) is not None:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        self.output_processor.add_request(req)
        if req.sampling_params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]    # the first position has no logprob; the rest come chunk by chunk
            if self._scorer is None:
                self._make_scorer()
        self.scheduler.add_request(req)
        self.structured_output.add_request(req)    # a constrained request gets its own grammar matcher

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Validate and queue a request (offline rules: generation stops at max_model_len)."""
        self.enqueue(self.make_request(request_id, prompt_token_ids, params, prompt, arrival_time))

    def abort_request(self, request_ids) -> None:
        if self.scheduler is None:          # an embedding engine queues nothing
            return
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self.structured_output.remove(rid)

    def has_unfinished_requests(self) -> bool:
        # a step in flight whose requests all finished or were aborted needs no more steps
        return self.scheduler is not None and self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """schedule → dispatch → process the previous step's outputs → return them.

        With async scheduling (the default) the host never waits for the device between steps: step N+1 is
        dispatched before step N's tokens are read, and reading them overlaps step N+1 on the device. The
        scheduler counts each token a dispatched step samples as a PLACEHOLDER (positions, blocks and the
        length limit need only the count); the token itself goes from step N's output to step N+1's input on
        the device, and the output processor fills it in when step N is read. A request that stopped at
        step N has computed one token too many in N+1 (up to num_steps with multi-step): the processor drops
        it. Without async scheduling each step is read before step() returns.
        """
        t0 = time.perf_counter()
        if not self.scheduler.scoring_ready:
            self._wait_for_scorer()
        scheduler_output = self.scheduler.schedule()
        outputs = self._dispatch(scheduler_output)
        outputs += self._process_in_flight(keep=self._lookahead if scheduler_output.scheduled else 0)
        self._step_ms += (time.perf_counter() - t0) * 1e3
        return outputs

    def _dispatch(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Send the scheduled step to the device and let the scheduler count its tokens. Returns the outputs
        of the steps it first had to read: penalties need the real token history on the host, and a step
        with structured-output rows needs its previous tokens in the matchers before its bitmask exists.

        A step with constrained rows goes in two halves: its forward (the device starts on it), then the
        step in flight is read, its tokens advance the matchers, those rows' bitmask fills on a worker
        thread while the output processor reads the step, and the sampler follows with the mask. A step
        with none is one ``runner.dispatch``: today's program, no extra host work."""
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return []
        needs_history = self.scheduler.num_penalized and self._needs_history(scheduled)
        outputs = self._process_in_flight(keep=0) if needs_history else []
        prev = self._in_flight[-1].pending if self._in_flight else None
        constrained = self.structured_output.constrained_rows(scheduled)
        if constrained is None:
            pending = self.runner.dispatch(scheduled, prev)
        else:
            forward = self.runner.dispatch_forward(scheduled, prev)
        scored = self._score_prompt_chunks(scheduled) if self.scheduler.num_scoring else []
        self.scheduler.update_from_output(scheduler_output)
        running = RequestStatus.RUNNING
        sampled = [(s.request, len(s.request.output_token_ids) - s.num_steps)
                   for s in scheduled if s.samples and s.request.status == running]
        if constrained is not None:
            so, mask = self.structured_output, None
            while self._in_flight:                  # (one step at most with async scheduling)
                step, result = self._read(self._in_flight.popleft())
                so.advance(step.sampled, result.token_ids)
                if not self._in_flight:             # the matchers are current: fill while the outputs are made
                    mask = so.start_fill(constrained, forward.num_rows)
                outputs += self._process_read(step, result)
            mask = mask or so.start_fill(constrained, forward.num_rows)
            pending = self.runner.dispatch_sample(forward, mask.result())
        self._in_flight.append(_InFlight(pending, sampled, scored))
        return outputs

    @staticmethod
    def _needs_history(scheduled) -> bool:
        """Whether a scheduled request needs its previous token on the host before dispatch (penalties)."""
        return any(s.request.uses_penalties for s in scheduled)

    def _process_in_flight(self, keep: int) -> list[RequestOutput]:
        """Read the dispatched steps' tokens, oldest first, leaving the newest ``keep`` on the device; the
        output processor decides which requests finished, the scheduler frees them."""
        outputs: list[RequestOutput] = []
        while len(self._in_flight) > keep:
            outputs += self._process_read(*self._read(self._in_flight.popleft()))
        return outputs

    def _read(self, step: _InFlight):
        """The step with its sampled tokens (waits for the device)."""
        return step, self.runner.collect(step.pending)

    def _process_read(self, step: _InFlight, result) -> list[RequestOutput]:
        """The output processor reads a step's tokens; the scheduler frees the requests it finished."""
        if step.scored:
            self._scorer.collect(step.scored, self.tokenizer, self.config.max_logprobs)
        new, finished = self.output_processor.process_outputs(step.sampled, result.token_ids, result.logprobs)
        for status, request_ids in finished.items():
            self.scheduler.finish_requests(request_ids, status)
            if self.structured_output.has_requests:
                for rid in request_ids:
                    self.structured_output.remove(rid)
        return new

    def _make_scorer(self) -> None:
        """vLLM's prompt_logprobs (``runner.prompt_logprobs``), made for the first request that asks: its
        executables compile in the background while scoring requests wait in the queue."""
        from jaxserve.runner.prompt_logprobs import PromptLogprobsScorer
        self._scorer = PromptLogprobsScorer(self.model, self.runner.kv_caches, attn_backend=self.runner.backend,
                                            max_blocks_per_seq=self.runner.max_blocks_per_seq,
                                            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
                                            max_logprobs=self.config.max_logprobs, mesh=self.mesh,
                                            background=not self.runner.enforce_eager)
        self.scheduler.scoring_ready = self._scorer.ready()

    def _wait_for_scorer(self) -> None:
        """Let the scheduler take scoring requests once the scorer is compiled. A step with nothing else to
        run waits a little for it rather than spinning (the compiles want the cores and the GIL)."""
        if not self._scorer.ready() and not self._in_flight and \
                self.scheduler.num_running == 0 and self.scheduler.num_waiting <= self.scheduler.num_scoring:
            self._scorer.compiler.wait_all(timeout=0.02)
        self.scheduler.scoring_ready = self._scorer.ready()

    def _score_prompt_chunks(self, scheduled) -> list:
        """Score the prompt chunks this step computes (``runner.prompt_logprobs``)."""
        self.runner.kv_caches, scored = self._scorer.dispatch(scheduled, self.runner.kv_caches)
        return scored

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        if self.scheduler is None:
            return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        s = dict(self.scheduler.get_stats())
        rs = self.runner.stats
        s.update(rs.snapshot())
        # raw totals, so a benchmark can diff a window: host ms/step = (step_ms - device_ms) / steps
        s.update(step_ms_total=self._step_ms, runner_host_ms_total=rs.host_ms, device_ms_total=rs.device_ms,
                 tokens_total=rs.tokens)
        s["num_kv_blocks"] = self.runner.num_blocks
        variants = getattr(self.runner, "variants", None)
        if variants is not None:                # background compiles not done yet (the prompt scorer's too)
            s["step_variants_pending"] = variants.pending() + (self._scorer.pending() if self._scorer else 0)
        s.update(self.structured_output.stats())
        return s
