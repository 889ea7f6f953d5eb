"""The engine core: requests in, ``step()`` = schedule → dispatch → process the previous step's outputs →
``EngineCoreOutput``s out.

Single-threaded, and without text: the front end (``llm_engine.LLMEngine``) validates requests, detokenizes,
matches stop strings and renders RequestOutputs. The core runs in the front end's process
(``core_client.InprocClient``: the offline ``LLM`` by default) or in its own (``core_process``, behind
``core_client.MPClient``: the server by default). The roles, in vLLM v1's shape: the scheduler picks each
step's tokens and counts the tokens a dispatched step will sample as placeholders; the runner (built by the
``ModelExecutor``) dispatches steps; ``core_outputs.apply_sampled_tokens`` reads their tokens and alone
decides that a request is finished (and why), which the scheduler then frees.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from jaxserve.config import EngineConfig
from jaxserve.engine.core_outputs import apply_sampled_tokens
from jaxserve.engine.embedder import Embedder, is_embedding_model
from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.lora_manager import LoRAManager
from jaxserve.engine.messages import EngineCoreOutput
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.speculator import load_draft, make_speculator
from jaxserve.engine.structured_output import StructuredOutputManager
from jaxserve.errors import InvalidRequestError
from jaxserve.executor.model_executor import ModelExecutor
from jaxserve.lora.peft import AdapterError
from jaxserve.runner.model_runner import resolve_attention_backend
from jaxserve.runner.ngram_device import spec_async
from jaxserve.sampling_params import SamplingParams
from jaxserve.utils import startup_timeline

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"     # the embedded default model
# how long a step with nothing to run but requests waiting for their grammar waits for a compile
FSM_IDLE_WAIT_S = 0.02


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
    is_multimodal: bool = False           # the model takes images (its family has a vision encoder)
    whole_images: bool = False            # a step computes an image's tokens all together (whole_images)
    startup_phases: tuple = ()            # the core process's start-up timeline: (phase, seconds, detail)
    startup_seconds: float | None = None  # the core process's wall seconds from its start to these facts
    platform: str = "cpu"                 # the core's JAX backend (jax.default_backend())

    @property
    def served_model_name(self) -> str:
        # vLLM's rule: the --served-model-name, else the model argument as given
        return self.config.served_model_name or self.config.model or DEFAULT_SERVED_NAME


@dataclasses.dataclass(slots=True)
class _InFlight:
    """A dispatched step whose tokens are not read yet."""
    pending: object                               # runner.PendingStep
    sampled: list[tuple[Request, int]]            # (request, index of its first placeholder of this step)
    scored: list = dataclasses.field(default_factory=list)   # prompt_logprobs chunks scored after the step


class EngineCore:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.executor = ModelExecutor(config)
        config = self.config = self.executor.config
        self.model = self.executor.model
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        self.chat_template = config.chat_template or self.model.chat_template
        # an image's tokens in one step: asked for, or needed (they attend to each other both ways)
        self.whole_images = config.scheduler.disable_chunked_mm_input or \
            getattr(self.model.family, "bidirectional_images", False)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
            disable_any_whitespace=config.structured_outputs_config.disable_any_whitespace,
            disable_additional_properties=config.structured_outputs_config.disable_additional_properties,
            limits=config.structured_outputs_config)
        # dispatched steps, oldest first; with async scheduling one stays on the device between step() calls
        self._in_flight: deque[_InFlight] = deque()
        self._lookahead = 1 if config.async_scheduling else 0
        self.speculator = None            # --speculative-config (``speculator``)
        # pipeline stages' batch queue: up to one step per stage in flight, of disjoint requests (the scheduler
        # skips those with a token in flight), so no step reads another's tokens on the device
        par = config.parallel
        self._batch_queue = par.pipeline_parallel_size if par.pipeline_parallel_size > 1 and \
            par.pipeline_batch_queue and config.async_scheduling else 0
        self._scorer = None
        self._step_ms = 0.0                       # wall time inside step(), summed (host + device waits)
        self._images = [0, 0]                     # images in requests, requests with images (stats)
        self.multi_process = self.executor.multi_process
        self.embedder = self.runner = self.scheduler = self.kv_manager = self.encoder_cache = self.lora = None
        t0 = time.perf_counter()
        if is_embedding_model(self.model, config.task):
            if self.multi_process or config.parallel.pipeline_parallel_size > 1:
                raise ValueError("embedding models run in a single process, in one stage (no --num-processes / "
                                 "--distributed-executor-backend mp / --pipeline-parallel-size)")
            # an embedding engine: no KV cache, no scheduler; requests go straight to the bucketed Embedder
            self.embedder = Embedder(self.model, attn_backend=resolve_attention_backend(config.attention_backend),
                                     block_size=config.cache.block_size, max_length=config.max_model_len,
                                     model_name=config.served_model_name)
            self.max_model_len = self.embedder.max_length
            if not config.skip_warmup:
                with startup_timeline.phase("warm-up"):
                    self.embedder.warmup(progress=progress)
        else:
            draft = load_draft(self.executor, config)
            self.runner = self.executor.build_runner()
            # the loader checked it against the model, the runner against the KV cache
            self.max_model_len = self.model.max_model_len
            cross_attention = getattr(self.runner, "cross_attention", False)
            self.kv_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                             config.cache.enable_prefix_caching, self.max_model_len,
                                             images_key_every_block=cross_attention)
            self.encoder_cache = None
            if self.runner.encoder is not None:
                # a cross-attention model's cache counts images (slots), not image tokens
                limits = getattr(self.runner.encoder, "scheduler_limits", config.scheduler.encoder_limits)()
                self.encoder_cache = EncoderCacheManager(*limits, whole_images=self.whole_images,
                                                         whole_request=cross_attention)
            self.lora = None              # LoRA adapters' slots (--enable-lora)
            if config.lora.enable_lora:
                lc = config.lora
                self.lora = LoRAManager(self.runner.write_lora_slot, self.model_config, lc.max_loras,
                                        lc.max_lora_rank, lc.max_cpu_loras)
            self.scheduler = Scheduler(config.scheduler, config.cache, self.kv_manager, self.max_model_len,
                                       self.encoder_cache, self.lora)
            if config.speculative_config is not None:
                self.speculator = make_speculator(self, config, draft)
                # a draft model proposes from the tokens read: synchronous steps; n-gram ones overlap the host
                # with the device under spec_async (JAXSERVE_SPEC_ASYNC; by default on a GPU)
                if draft is not None or not spec_async():
                    self._lookahead = 0
                self.scheduler.async_drafts = self._lookahead > 0
                # async n-gram: the runner proposes on the device after every step (``runner.ngram_device``)
                self.speculator.on_device = getattr(self.runner, "ngram", None) is not None
            if self._batch_queue:
                self.scheduler.num_batches = self._lookahead = self._batch_queue
            self.executor.warm_up(progress=progress)
            if draft is not None and not config.skip_warmup:
                draft.warmup(progress=progress)
            if self.multi_process:
                # the processes follow the steps process 0 sends, and a step carries no bitmask
                self.structured_output.unsupported_reason = (
                    "the model is spread over several processes (--num-processes / "
                    "--distributed-executor-backend mp); run it in one process (-tp over its local GPUs)")
        self.warmup_seconds = time.perf_counter() - t0

    def facts(self) -> EngineFacts:
        model = self.model
        return EngineFacts(
            config=self.config, tokenizer=self.tokenizer, model_config=self.model_config,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, chat_template=self.chat_template,
            is_embedding=self.embedder is not None, multi_process=self.multi_process,
            structured_unsupported_reason=self.structured_output.unsupported_reason,
            model_source=str(getattr(model, "source", self.config.model)),
            load_format=str(getattr(model, "load_format", self.config.load_format)),
            dtype_name=str(getattr(model.dtype, "__name__", model.dtype)),
            load_seconds=self.executor.load_seconds, warmup_seconds=self.warmup_seconds,
            num_kv_blocks=self.runner.num_blocks if self.runner is not None else None,
            is_multimodal=self.runner is not None and self.runner.encoder is not None,
            whole_images=self.whole_images, startup_phases=tuple(startup_timeline.timeline()),
            startup_seconds=startup_timeline.seconds_since_process_start(), platform=_platform())

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, sampling_seed: int, *, priority: int = 0,
                    cache_salt: str | None = None, mm_features: list | None = None, lora_request=None) -> None:
        """Queue a request the front end validated (``LLMEngine.make_request``); ``params`` are its own
        copy. A constrained request whose grammar is not compiled yet waits apart (WAITING_FOR_FSM, no
        batch slot) until ``step`` finds it compiled. Raises InvalidRequestError if its id is in use."""
        so = self.structured_output
        if self.scheduler.get_request(request_id) is not None or so.is_waiting(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                      arrival_time=arrival_time, sampling_seed=sampling_seed, priority=priority,
                      cache_salt=cache_salt, mm_features=mm_features, lora_request=lora_request)
        if lora_request is not None:
            self._check_lora(lora_request, params)
        if mm_features:
            self._images[0] += len(mm_features)
            self._images[1] += 1
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]    # the first position has no logprob; the rest come chunk by chunk
            if self._scorer is None:
                self._make_scorer()
        if params.structured_outputs is not None and not so.start_request(req):
            req.status = RequestStatus.WAITING_FOR_FSM
            return
        self.scheduler.add_request(req)

    def _check_lora(self, lora_request, params: SamplingParams) -> None:
        """The adapter can serve this request: LoRA is on and its folder reads (kept in the host cache)."""
        if self.lora is None or params.prompt_logprobs is not None:    # (the front end refused these)
            raise InvalidRequestError("LoRA is not enabled, or the request asks for prompt_logprobs", param="model")
        try:
            self.lora.read(lora_request)
        except AdapterError as e:
            raise InvalidRequestError(str(e), param="model") from None

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.scheduler is None:          # an embedding engine queues nothing
            return
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self.structured_output.remove(rid)

    def has_unfinished_requests(self) -> bool:
        # a step in flight whose requests all finished or were aborted needs no more steps
        return self.scheduler is not None and (self.scheduler.has_unfinished_requests()
                                               or self.structured_output.num_waiting > 0)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[EngineCoreOutput]:
        """schedule → dispatch → process the previous step's outputs → return them.

        With async scheduling (the default) the host never waits for the device between steps: step N+1 is
        dispatched before step N's tokens are read, and reading them overlaps step N+1 on the device. The
        scheduler counts each token a dispatched step samples as a PLACEHOLDER (positions, blocks and the
        length limit need only the count); the token itself goes from step N's output to step N+1's input on
        the device, and ``apply_sampled_tokens`` fills it in when step N is read. A request that stopped at
        step N has computed one token too many in N+1 (up to num_steps with multi-step): it is dropped.
        Without async scheduling each step is read before step() returns.
        """
        t0 = time.perf_counter()
        outputs = self._admit_compiled() if self.structured_output.num_waiting else []
        if not self.scheduler.scoring_ready:
            self._wait_for_scorer()
        if self.speculator is not None:
            if self._in_flight and (self.scheduler.num_penalized or self.structured_output.has_requests):
                # a step that reads its predecessor before dispatch (penalties, structured outputs) would
                # find its entries placed past drafts that step rejects: read it first
                outputs += self._process_in_flight(keep=0)
            self.speculator.propose(self.scheduler.running, getattr(self.runner.ngram, "last_rows", None)
                                    if self.speculator.on_device else None)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.scheduled:
            outputs += self._dispatch(scheduler_output)
        # nothing scheduled: read the oldest step (all of them when only one may be in flight)
        outputs += self._process_in_flight(keep=self._lookahead if scheduler_output.scheduled else
                                           max(len(self._in_flight) - 1, 0))
        self._step_ms += (time.perf_counter() - t0) * 1e3
        return outputs

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is compiled now; end those whose constraint was refused (an
        error, with the compiler's message). With nothing else to run, wait a little for a compile rather
        than spin (the compile wants the cores)."""
        so = self.structured_output
        if not self.scheduler.has_unfinished_requests() and not self._in_flight:
            so.wait_for_compile(FSM_IDLE_WAIT_S)
        ready, refused = so.take_compiled()
        for req in ready:
            req.status = RequestStatus.WAITING
            self.scheduler.add_request(req)
        outputs = []
        for req, message in refused:
            req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, message
            outputs.append(EngineCoreOutput(req.request_id, [], int(RequestStatus.FINISHED_ERROR), message))
        return outputs

    def _dispatch(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """Send the scheduled step to the device and let the scheduler count its tokens. Returns the outputs
        of the steps it had to read first: penalties need the real token history on the host before the step
        goes, a step with structured-output rows its previous tokens in the matchers before its sampler."""
        scheduled = scheduler_output.scheduled
        outputs = self._process_in_flight(keep=0) if self._needs_history(scheduled) else []
        prev = self._in_flight[-1].pending if self._in_flight and not self._batch_queue else None
        constrained = self.structured_output.constrained_rows(scheduled)
        mm = scheduler_output.mm_requests is not None
        if mm:
            freed = self.encoder_cache.take_freed()
            if freed:
                self.runner.free_encoder_outputs(freed)
        dispatch = self.runner.dispatch if constrained is None else self.runner.dispatch_forward
        # some entry verifies draft tokens (``speculator``), or follows a step in flight that verified some
        spec = scheduler_output.num_draft_tokens > 0 or (prev is not None and bool(prev.drafts))
        # (keywords only where used: a BroadcastingRunner, which serves neither, takes none)
        pending = dispatch(scheduled, prev, mm=mm, spec=spec) if mm or spec else dispatch(scheduled, prev)
        scored = self._score_prompt_chunks(scheduled) if self.scheduler.num_scoring else []
        running = RequestStatus.RUNNING
        # each sampling entry's first placeholder of this step: the outputs it has before the scheduler counts
        # the step's (one, num_steps multi-step, or 1 + its drafts speculating)
        sampled = [(s.request, len(s.request.output_token_ids))
                   for s in scheduled if s.samples and s.request.status == running]
        self.scheduler.update_from_output(scheduler_output)
        if constrained is not None:
            pending = self._sample_constrained(pending, constrained, outputs)
        self._in_flight.append(_InFlight(pending, sampled, scored))
        return outputs

    def _needs_history(self, scheduled) -> bool:
        """Whether a scheduled request needs its previous token on the host before dispatch (penalties)."""
        return bool(self.scheduler.num_penalized) and any(s.request.uses_penalties for s in scheduled)

    def _sample_constrained(self, forward, constrained, outputs: list[EngineCoreOutput]):
        """The second half of a step with constrained rows, whose forward the device is running: read the
        step in flight (appending its outputs to ``outputs``), its tokens advance the matchers, those rows'
        bitmask fills on a worker thread while its outputs are made, and the sampler follows with the mask.
        (A step with none is one ``runner.dispatch``: today's program, no extra host work.)"""
        so, mask = self.structured_output, None
        while self._in_flight:                  # (one step at most with async scheduling)
            step, result = self._read(self._in_flight.popleft())
            so.advance(step.sampled, result.token_ids)
            if not self._in_flight:             # the matchers are current: fill while the outputs are made
                mask = so.start_fill(constrained, forward.num_rows)
            outputs += self._process_read(step, result)
        mask = mask or so.start_fill(constrained, forward.num_rows)
        return self.runner.dispatch_sample(forward, mask.result())

    def _process_in_flight(self, keep: int) -> list[EngineCoreOutput]:
        """Read the dispatched steps' tokens, oldest first, leaving the newest ``keep`` on the device."""
        outputs: list[EngineCoreOutput] = []
        while len(self._in_flight) > keep:
            outputs += self._process_read(*self._read(self._in_flight.popleft()))
        return outputs

    def _read(self, step: _InFlight):
        """The step with its sampled tokens (waits for the device)."""
        return step, self.runner.collect(step.pending)

    def _process_read(self, step: _InFlight, result) -> list[EngineCoreOutput]:
        """Apply a read step's tokens (which decides the requests that finished); the scheduler frees those."""
        if step.scored:
            self._scorer.collect(step.scored, self.tokenizer, self.config.max_logprobs)
        so = self.structured_output
        outputs, finished = apply_sampled_tokens(step.sampled, result.token_ids, result.logprobs,
                                                 so if so.has_requests else None, result.spec)
        for status, request_ids in finished.items():
            self.scheduler.finish_requests(request_ids, status)
            if so.has_requests:
                for rid in request_ids:
                    so.remove(rid)
        if result.proposed is not None:
            self.speculator.read_proposals(result.proposed)
        if result.spec:
            self.speculator.record(result.spec)
            self._after_roll_back(result.spec)
        return outputs

    def _after_roll_back(self, spec: dict[str, tuple[int, int, int]]) -> None:
        """A read speculative step rolled back its rejected drafts: the steps in flight after it, placed past
        them, take their tokens from indices as many lower; a request capped on them runs again."""
        rolled = {rid: d - a for rid, (d, a, _) in spec.items() if d > a}
        if not rolled:
            return
        for later in self._in_flight:
            later.sampled = [(r, f - rolled.get(r.request_id, 0)) for r, f in later.sampled]
        capped = self.scheduler.capped
        for rid in rolled:
            req = capped.get(rid)
            if req is not None and len(req.output_token_ids) < req.max_output_tokens:
                self.scheduler.uncap(req)

    # ---------------------------------------------------------------- prompt logprobs
    def _make_scorer(self) -> None:
        """vLLM's prompt_logprobs (``runner.prompt_logprobs``), made for the first request that asks: its
        executables compile in the background while scoring requests wait in the queue."""
        from jaxserve.runner.prompt_logprobs import PromptLogprobsScorer
        self._scorer = PromptLogprobsScorer(self.model, self.runner.kv_caches, attn_backend=self.runner.backend,
                                            max_blocks_per_seq=self.runner.max_blocks_per_seq,
                                            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
                                            max_logprobs=self.config.max_logprobs, mesh=self.executor.mesh,
                                            background=not self.runner.enforce_eager,
                                            params=lambda: self.runner.step_params)
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

    # ---------------------------------------------------------------- stats and lifecycle
    def stats(self) -> dict:
        if self.scheduler is None:
            return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        s = dict(self.scheduler.get_stats())
        s["num_waiting"] += self.structured_output.num_waiting      # (those waiting for their grammar)
        rs = self.runner.stats
        s.update(rs.snapshot())
        # raw totals, so a benchmark can diff a window: host ms/step = (step_ms - device_ms) / steps
        s.update(step_ms_total=self._step_ms, runner_host_ms_total=rs.host_ms, device_ms_total=rs.device_ms,
                 tokens_total=rs.tokens, padded_tokens_total=rs.padded_tokens)
        s["num_kv_blocks"] = self.runner.num_blocks
        if getattr(self.runner, "variants", None) is not None:
            # background compiles not done yet (a vision encoder's, the prompt scorer's and a draft's too)
            s["step_variants_pending"] = self.runner.pending_compiles() + \
                (self._scorer.pending() if self._scorer else 0) + \
                (self._draft_runner().pending_compiles() if self._draft_runner() is not None else 0)
        s.update(self.structured_output.stats())
        if self.speculator is not None:
            s.update(self.speculator.stats())
        if self.lora is not None:       # vLLM's lora_requests_info labels
            s.update(lora_running=self.lora.running_names(), max_loras=self.config.lora.max_loras,
                     lora_waiting=self.lora.waiting_names(self.scheduler.waiting))
        if self.encoder_cache is not None:
            s.update(self.encoder_cache.stats(), encoder_seconds_total=self.runner.encoder.encode_ms / 1e3,
                     request_images_total=self._images[0], requests_with_images_total=self._images[1])
        return s

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the step variants compiling in the background are done (False after ``timeout``)."""
        draft = self._draft_runner()
        return True if self.runner is None else self.runner.wait_compiled(timeout) and \
            (draft is None or draft.wait_compiled(timeout))

    def _draft_runner(self):
        """The draft model's runner (``--speculative-config`` with method draft_model), else None."""
        draft = self.speculator.draft if self.speculator is not None else None
        return draft.runner if draft is not None else None

    def shutdown(self) -> None:
        """Release the processes following this one's steps, and stop the background compiles: once they
        are gone nothing holds the weights and KV cache, and the next engine can claim the memory."""
        if self.runner is None:
            return
        release_followers = getattr(self.runner, "stop", None)     # BroadcastingRunner (jax.distributed)
        if release_followers is not None:
            release_followers()
        self.runner.stop_background_compiles(wait=True)
        if self._draft_runner() is not None:
            self._draft_runner().stop_background_compiles(wait=True)


def _platform() -> str:
    import jax  # noqa: PLC0415  (the core has started its backend by now)
    return jax.default_backend()
