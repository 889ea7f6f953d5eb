"""The engine: add requests, then ``step()`` = schedule → dispatch → post-process the previous step.

Single-threaded. Used directly by the offline ``LLM`` class and, on a background thread, by the async front.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from jaxserve.engine.embedder import Embedder, is_embedding_model
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, validate_prompt_length
from jaxserve.engine.structured_output import StructuredOutputManager
from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner.model_runner import PLACEHOLDER, ModelRunner, resolve_attention_backend
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"     # the embedded default model

# What update_from_output appends for each sampling request of a dispatched step (read-only, shared).
_PLACEHOLDER_ONLY = (PLACEHOLDER,)


@dataclasses.dataclass(slots=True)
class _InFlight:
    pending: object                               # runner.PendingStep
    index: dict[str, tuple[Request, int]]         # request id -> (request, index of its first placeholder)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        import jax

        from jaxserve.models import load_model
        from jaxserve.runner import compile_cache

        from jaxserve.parallel import launcher
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
                                max_model_len=config.max_model_len, mesh=mesh)
        self.load_seconds = time.perf_counter() - t0
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        if config.tokenizer:                # --tokenizer: another HF tokenizer folder for this model
            from transformers import AutoTokenizer
            self.tokenizer = self.model.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.chat_template = config.chat_template or self.model.chat_template
        self.eos_token_ids = tuple(self.model_config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
            disable_any_whitespace=config.structured_outputs_config.disable_any_whitespace)
        self._cum_logprob: dict[str, float] = {}
        self._logprobs: dict[str, list] = {}
        self._sent: dict[str, tuple[int, int]] = {}   # tokens / chars already returned (DELTA mode)
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._inflight: _InFlight | None = None
        self._prompt_lps: dict[str, list] = {}
        self._scorer = None
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
                from jaxserve.parallel import BroadcastingRunner
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

    # ---------------------------------------------------------------- requests
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
        if params.structured_outputs is not None:
            self.structured_output.compile(params.structured_outputs)    # cached; raises naming the problem

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        prompt_token_ids = list(prompt_token_ids)
        keep = params.truncate_prompt_tokens
        if keep == -1:                      # vLLM: -1 = keep up to max_model_len tokens (the last ones)
            keep = self.max_model_len
        if keep is not None and len(prompt_token_ids) > keep:
            prompt_token_ids = prompt_token_ids[-keep:]
        self.validate(prompt_token_ids, params, strict_length=False)
        # A per-request copy that knows the model's eos ids: the sampler blocks them below min_tokens.
        params = params.clone()
        params.update_from_generation_config({"eos_token_id": list(self.eos_token_ids)},
                                             self.eos_token_ids[0] if self.eos_token_ids else None)
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                      arrival_time=arrival_time or time.time(), prompt=prompt)
        req.sampling_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31 - 1))
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self._cum_logprob[request_id] = 0.0
        self._logprobs[request_id] = [] if params.logprobs is not None else None
        self._sent[request_id] = (0, 0)
        if params.prompt_logprobs is not None:
            self._prompt_lps[request_id] = self._score_prompt(prompt_token_ids, params.prompt_logprobs)
        self.scheduler.add_request(req)
        self.structured_output.add_request(req)    # structured outputs: the request's own matcher

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if self.scheduler is None:          # an embedding engine queues nothing
            return
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        for d in (self._detok, self._cum_logprob, self._logprobs, self._sent, self._prompt_lps):
            d.pop(rid, None)
        self.structured_output.remove(rid)

    def has_unfinished_requests(self) -> bool:
        if self.scheduler is None:
            return False
        if self.scheduler.has_unfinished_requests():
            return True
        # a step in flight whose requests are all aborted needs no more steps
        return self._inflight is not None and any(rid in self._detok for rid in self._inflight.index)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """schedule → dispatch → (process the previous step's tokens while this one runs) → record.

        With async scheduling (the default) the host never waits for the device between steps: step N+1 is
        scheduled and dispatched before step N's tokens are read. The scheduler sees each sampled token as
        a PLACEHOLDER first (its count is what scheduling needs: positions, blocks, max_tokens); the token
        itself goes from step N's output to step N+1's input on the device. Reading step N's results then
        overlaps step N+1 on the device; a request that stopped (EOS, stop id or string) at step N has
        computed one token too many in N+1 (up to num_steps with multi-step), which is dropped. Penalties
        need the real history on the host, so a step that uses them first resolves the step in flight. A
        multi-step decode (the scheduler's ``num_steps`` > 1) works the same way with ``num_steps``
        placeholders per request.
        """
        sched = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        if prev is not None and (not sched.scheduled or self._needs_history(sched)):
            outputs += self._resolve(prev)
            prev = None
        if not sched.scheduled:
            return outputs
        constrained = self.structured_output.constrained_rows(sched.scheduled)
        if constrained is None:
            pending = self.runner.dispatch(sched.scheduled, prev.pending if prev is not None else None)
            if prev is not None:
                outputs += self._resolve(prev)  # blocks on step N while the device runs step N+1
        else:
            # structured outputs: step N+1's forward runs while step N's tokens are read and advance the
            # matchers; then the host fills the bitmask and step N+1's sampler follows
            fwd = self.runner.dispatch_forward(sched.scheduled, prev.pending if prev is not None else None)
            if prev is not None:
                outputs += self._resolve(prev)
            pending = self.runner.dispatch_sample(fwd, self.structured_output.fill_bitmask(constrained,
                                                                                         fwd.num_rows))
        # the scheduler counts the new tokens now; their values arrive with _resolve
        if sched.num_steps > 1:                 # multi-step: one placeholder per iteration each entry runs
            self.scheduler.update_from_output(sched, {s.request.request_id: (PLACEHOLDER,) * s.num_steps
                                                      for s in sched.scheduled})
        else:
            self.scheduler.update_from_output(sched, dict.fromkeys(pending.rows, _PLACEHOLDER_ONLY))
        index = {}
        for s in sched.scheduled:
            if s.samples:
                out_ids = s.request.output_token_ids
                if out_ids and out_ids[-1] == PLACEHOLDER:
                    # the first of this step's placeholders (a request may have finished by length on it)
                    index[s.request.request_id] = (s.request, len(out_ids) - s.num_steps)
        inflight = _InFlight(pending, index)
        if self.config.async_scheduling:
            self._inflight = inflight
        else:
            outputs += self._resolve(inflight)
        return outputs

    def _needs_history(self, sched) -> bool:
        """Whether a scheduled request needs its previous token on the host before dispatch (penalties)."""
        return any(s.request.uses_penalties for s in sched.scheduled)

    def _resolve(self, inflight: "_InFlight") -> list[RequestOutput]:
        """Bring a dispatched step's tokens to the host: fill the placeholders, stop checks, detokenize.

        The hot loop of the host (once per request per step): attribute lookups are hoisted, the common
        case (no stop, no logprobs, FINAL_ONLY output while running) does no more than it must."""
        result = self.runner.collect(inflight.pending)
        now = time.time()
        outputs = []
        detoks = self._detok
        token_ids = result.token_ids
        logprobs = result.logprobs
        stopped = RequestStatus.FINISHED_STOPPED
        length_capped = RequestStatus.FINISHED_LENGTH_CAPPED
        final_only = RequestOutputKind.FINAL_ONLY
        finish_request = self.scheduler.finish_request
        structured = self.structured_output if self.structured_output.has_requests else None
        for rid, (req, first) in inflight.index.items():
            detok = detoks.get(rid)
            if detok is None:                   # aborted meanwhile
                continue
            toks = token_ids[rid]
            lps = logprobs.get(rid) if logprobs else None
            if type(toks) is int:               # one step (a multi-step dispatch gives lists)
                toks, lps = (toks,), ((lps,) if lps is not None else None)
            last = len(toks) - 1
            for j, tok in enumerate(toks):
                idx = first + j
                req.set_output_token(idx, tok)
                # EOS / stop-token-id check (vLLM's rules: only from min_tokens on; EOS unless ignore_eos)
                is_eos = not req.ignore_eos and tok in req.eos_token_ids
                if idx + 1 >= req.min_tokens and (is_eos or tok in req.stop_token_ids):
                    reason = None if is_eos else tok
                    if req.status == length_capped:  # retired by length on the same token: the stop wins
                        req.status, req.stop_reason = stopped, reason
                    else:                            # running, or preempted while this step was in flight
                        finish_request(rid, stopped, stop_reason=reason)
                # structured outputs: the matcher takes the token; a grammar that ended stops like EOS
                if structured is not None and structured.accept(rid, tok) and req.status != stopped:
                    if req.status == length_capped:
                        req.status, req.stop_reason = stopped, None
                    else:
                        finish_request(rid, stopped)
                if lps is not None:
                    self._record_logprobs(rid, tok, lps[j])
                # finished by length shows on the request from its last placeholder on, not before
                finished = req.status > RequestStatus.PREEMPTED and (j == last or req.status != length_capped)
                detok.update((tok,), finished)       # finished releases held-back text
                if detok.stop_reason is not None and req.status != stopped:
                    if req.status == length_capped:  # a stop string on the capped token (or before it) wins
                        req.status, req.stop_reason = stopped, detok.stop_reason
                    else:
                        finish_request(rid, stopped, stop_reason=detok.stop_reason)
                    finished = True
                if finished:
                    break
            metrics = req.metrics
            metrics.last_token_time = now
            if finished:
                if len(req.output_token_ids) > idx + 1:
                    req.truncate_output(idx + 1)    # drop tokens computed after the stop
            elif req.sampling_params.output_kind is final_only:
                continue
            out = self._make_output(req, finished)
            if out is not None:
                outputs.append(out)
            if finished:
                metrics.finished_time = now
                self._forget(rid)
        return outputs

    def _score_prompt(self, prompt_token_ids: list[int], k: int) -> list:
        """vLLM's prompt_logprobs: [None, {token: Logprob, top-k...}, ...] (an extra prefill of the prompt)."""
        if self._scorer is None:
            from jaxserve.runner.prompt_logprobs import PromptScorer
            self._scorer = PromptScorer(self.model, attn_backend=self.runner.backend,
                                        block_size=self.config.cache.block_size,
                                        max_logprobs=self.config.max_logprobs, mesh=self.mesh)
        k = self.config.max_logprobs if k == -1 else k
        out = []
        for tok, entry in zip(prompt_token_ids, self._scorer.score(prompt_token_ids)):
            if entry is None:
                out.append(None)
                continue
            lp, rank, top_ids, top_lps = entry
            out.append(decode_logprobs(self.tokenizer, tok, lp, rank, top_ids, top_lps, num_logprobs=k))
        return out

    def _record_logprobs(self, rid, token, lp) -> None:
        if lp is None:
            return
        logprob, rank, top_ids, top_lps = lp
        self._cum_logprob[rid] += logprob
        self._logprobs[rid].append(decode_logprobs(self.tokenizer, token, logprob, rank, top_ids, top_lps))

    def _make_output(self, req: Request, finished: bool) -> RequestOutput | None:
        params: SamplingParams = req.sampling_params
        kind = params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        detok = self._detok[req.request_id]
        text = detok.output_text
        lps = self._logprobs[req.request_id]
        if kind == RequestOutputKind.DELTA:     # only the new part is copied
            n_tok, n_chr = self._sent[req.request_id]
            toks = req.output_token_ids[n_tok:]
            self._sent[req.request_id] = (n_tok + len(toks), len(text))
            text = text[n_chr:]
            lps = lps[n_tok:] if lps is not None else None
        else:
            toks = list(req.output_token_ids)
        cum = self._cum_logprob[req.request_id] if params.logprobs is not None else None
        comp = CompletionOutput(index=0, text=text, token_ids=toks, cumulative_logprob=cum, logprobs=lps,
                                finish_reason=req.finish_reason if finished else None,
                                stop_reason=req.stop_reason if finished else None)
        prompt_lps = self._prompt_lps.get(req.request_id)
        if kind == RequestOutputKind.DELTA:     # sent once, with the first delta
            self._prompt_lps.pop(req.request_id, None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, prompt_logprobs=prompt_lps, outputs=[comp],
                             finished=finished, metrics=req.metrics, num_cached_tokens=req.num_cached_tokens)

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        if self.scheduler is None:
            return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        s = dict(self.scheduler.get_stats())
        s.update(self.runner.stats.snapshot())
        s.update(self.structured_output.stats())
        s["num_kv_blocks"] = self.runner.num_blocks
        return s
