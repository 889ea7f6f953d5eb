"""The device side of a step: a scheduler decision in, the sampled tokens out, the host never waiting.

``dispatch(scheduled, prev)`` builds the step's inputs (``step_inputs``), launches its forward and sampler
(``step_variants``: the compiled executables) and returns at once; ``collect`` later waits for the
tokens. A token the step in flight samples feeds the next step on the device (``prev``), so step N+1 is
dispatched before step N is read. A structured-output step splits the dispatch in two: ``dispatch_forward``,
then the host fills the bitmask while the forward runs, then ``dispatch_sample``. A multi-step decode
(``multi_step``) runs forward and sampler in one loop. A speculative step (``spec=True``) is a plain step that
also verifies each request's draft tokens: its forward returns logits at K + 1 positions per request and
the rejection sampler (``rejection_sampler``) returns the accepted tokens. The KV cache (``kv_cache``) is
donated to every step and updated in place.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kernels import ops as kernel_ops
from jaxserve.runner import kv_cache, packing, sampler as sampler_mod, step_inputs
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.ngram_device import DeviceNgram, device_ngram_enabled
# ExpertLoad, RunnerStats, MIN_TOKEN_BUCKET and token_buckets are imported from here too
from jaxserve.runner.stats import ExpertLoad, RunnerStats, moe_layers, runner_stats  # noqa: F401
from jaxserve.runner.step_inputs import MIN_TOKEN_BUCKET, StepShapes, forward_pack, token_buckets
from jaxserve.runner.step_variants import StepVariants

logger = logging.getLogger(__name__)


def resolve_attention_backend(name: str) -> str:
    if name != "auto":
        return name
    default = getattr(kernel_ops, "default_backend", None)
    return default() if default else "reference"


@dataclasses.dataclass(slots=True)
class StepResult:
    """What one step sampled, on the host: per scheduled request that samples. A multi-step dispatch
    returns a list per request instead (of ids, and of logprob tuples: one per iteration it ran)."""
    token_ids: dict[str, int] | dict[str, list[int]]
    # logprob, rank, top ids, top logprobs (a list of them per request after a multi-step dispatch)
    logprobs: dict[str, tuple[float, int, list[int], list[float]]] | dict[str, list[tuple]]
    # a speculative step: request id -> (draft slots placed, drafts accepted, drafts verified) for the requests
    # with drafts
    # (their token_ids are lists: the accepted drafts, then one drawn token)
    spec: dict[str, tuple[int, int, int]] | None = None
    # n-gram drafts proposed on the device after this step, per sampling request (``ngram_device``)
    proposed: dict[str, int] | None = None


@dataclasses.dataclass(slots=True)
class ForwardStep:
    """A step whose forward is dispatched and whose sampler is not yet (``ModelRunner.dispatch_forward``):
    the host fills the structured-output bitmask meanwhile."""
    logits: jax.Array
    s_ints: np.ndarray
    s_floats: np.ndarray
    s_layout: tuple
    key: tuple                       # the sampler variant: (logprobs, filter mode)
    rows: dict[str, int]
    logprobs_k: dict[str, int]
    num_tokens: int
    num_rows: int
    t_host: float                    # host ms spent on it so far
    expert_load: jax.Array | None = None
    drafts: dict[str, int] | None = None   # a speculative step: request id -> its draft tokens
    prev_rejected: jax.Array | None = None  # a speculative step: the previous step's rejected drafts per row
    hidden: jax.Array | None = None         # EAGLE: every token row's hidden state (``StepVariants.hidden_rows``)
    ngram: tuple | None = None              # device n-gram: (history rows, the previous step's drafts, counts)


@dataclasses.dataclass(slots=True)
class PendingStep:
    """A dispatched step whose results are still on the device."""
    out: object                      # SamplerOutput of device arrays (a leading [steps] axis when multi-step)
    tokens: jax.Array                # [max_num_seqs] sampled ids (feeds the next step's placeholders)
    rows: dict[str, int]             # request id -> row, for the requests that sample
    logprobs_k: dict[str, int]       # request id -> number of top logprobs wanted
    num_tokens: int
    steps: dict[str, int] | None = None   # multi-step: request id -> iterations it ran (out: [steps, R] ids)
    expert_load: jax.Array | None = None  # MoE: tokens per expert per layer, [L_moe, E] ([steps, ...] multi-step)
    drafts: dict[str, int] | None = None  # a speculative step: request id -> its draft tokens (out: SpecOutput)
    rejected: jax.Array | None = None     # a speculative step: [max_num_seqs] drafts each row rejected
    hidden: jax.Array | None = None       # EAGLE: every token row's hidden state, padded (on the device)
    proposed: jax.Array | None = None     # device n-gram: the drafts proposed after it per row (``ngram_device``)


@dataclasses.dataclass(slots=True)
class HiddenRows:
    """An EAGLE target's latest step: its token rows' hidden states (on the device) and where each request's
    rows are: (request, first row, first position, rows)."""
    hidden: jax.Array
    rows: list[tuple[object, int, int, int]]


def check_pipeline_supported(model, config: EngineConfig) -> None:
    """Refuse what pipeline stages do not run, with the flag to change."""
    family = model.family
    spec = getattr(config, "speculative_config", None)
    why = ("LoRA adapters (--enable-lora)" if config.lora.enable_lora else
           "speculative decoding (--speculative-config)" if spec is not None and getattr(spec, "method", None) else
           "multi-step decoding (--num-scheduler-steps > 1)" if config.scheduler.num_scheduler_steps > 1 else
           "a vision model" if hasattr(family, "encode_images") or getattr(family, "cross_attention", False) else
           "this model family" if not hasattr(family, "abstract_stage") else None)
    if why:
        raise ValueError(f"--pipeline-parallel-size {config.parallel.pipeline_parallel_size} does not support {why}; "
                         "use --tensor-parallel-size alone")


class ModelRunner:
    def __init__(self, model, config: EngineConfig, max_model_len: int, mesh=None, stages=None):
        """``stages``: pipeline stages (``parallel.pipeline.StageMeshes``); ``mesh`` is then the last one's."""
        if stages is not None:
            check_pipeline_supported(model, config)
            stages = stages.for_layers(model.config.num_layers)
            mesh = stages.meshes[-1]
        self.model, self.cfg, self.config, self.mesh, self.stages = model, model.config, config, mesh, stages
        # stages over several processes: the sampled tokens go to the first stage's devices, process 0's, where
        # the scheduler reads them (the last stage's may be another process's)
        self._to_driver = stages.replicated(0) if stages is not None and jax.process_count() > 1 else None
        self.block_size = config.cache.block_size
        sc = config.scheduler
        self.encoder = None
        # a cross-attention family (Mllama): every step with an image request reads its slot of the cache,
        # allocated first so that the KV cache is sized from the memory left after it
        self.cross_attention = getattr(model.family, "cross_attention", False)
        if self.cross_attention:
            from jaxserve.runner.cross_attention_cache import CrossAttentionCache  # noqa: PLC0415
            if sc.num_scheduler_steps > 1:
                raise ValueError("--num-scheduler-steps > 1 is not supported for cross-attention models")
            self.encoder = CrossAttentionCache(model, sc.cross_attention_slot_count(), max_batch=8, mesh=mesh)
        # LoRA adapters' device slots (``jaxserve.lora.slots``): beside the weights as the step's params["lora"];
        # made before the KV cache is sized, which counts the device memory in use
        self.lora = None
        if config.lora.enable_lora:
            from jaxserve.lora.slots import LoRASlots, check_supported  # noqa: PLC0415
            check_supported(model, config)
            self.lora = LoRASlots(model.config, model.params, config.lora.max_loras, config.lora.max_lora_rank,
                                  model.dtype, mesh)
        # the longest sequence the KV cache holds: the model's, or less where it does not fit (kv_cache.fit)
        dtype = kv_cache.kv_dtype(config, model.params)
        stage_layers = max(b - a for a, b in stages.bounds) if stages is not None else None
        self.num_blocks, max_model_len = kv_cache.fit(model.config, config, max_model_len, dtype, mesh, stage_layers)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.max_num_seqs, self.max_num_tokens = sc.max_num_seqs, sc.max_num_batched_tokens
        self.buckets = sorted({min(int(b), self.max_num_tokens) for b in sc.token_buckets} | {self.max_num_tokens}) \
            if sc.token_buckets else token_buckets(self.max_num_tokens)
        self.backend = resolve_attention_backend(config.attention_backend)
        kernel_ops.load_kernels(self.backend)
        if jax.default_backend() == "gpu" and self.buckets[0] < MIN_TOKEN_BUCKET:
            logger.warning("token bucket %d is below %d: a bucket of 1 decoded ~10x slower than 8 on the H200 (XLA "
                           "lowers one-row matmuls as multiply + reduce fusions); 2 is not measured in the engine",
                           self.buckets[0], MIN_TOKEN_BUCKET)
        # Steps whose requests all decode one token get their own variant of the small buckets under the
        # Pallas backends: the attention runs its decode launch alone (no prefill tile slots, the decode
        # tile's shared memory only). The reference has one path for both, so no extra compiles there.
        self.shapes = StepShapes(self.buckets, self.max_num_seqs, uniform_decode=self.backend != "reference")
        self.vocab_size = self.cfg.vocab_size
        # (MoE layers, experts): the step returns its expert load (not counted over pipeline stages)
        self.moe_layers = moe_layers(model) if stages is None else None
        self.stats = runner_stats(self.moe_layers)
        self.kv_caches = kv_cache.allocate(self.cfg, self.num_blocks, self.block_size, dtype, mesh, stages)
        # penalties ship output/prompt ids at one fixed width (max_model_len rounded up to a power of two)
        self.penalty_width = sampler_mod.length_bucket(max_model_len)
        # a vision model: the encoder step and its cache (``encoder_cache``; a cross-attention one's is above)
        if not self.cross_attention and hasattr(model.family, "encode_images"):
            from jaxserve.runner.encoder_cache import EncoderCache  # noqa: PLC0415
            budget, capacity = sc.encoder_limits()
            self.encoder = EncoderCache(model, capacity, max_batch=8, mesh=mesh, budget=budget,
                                        warm_tokens=min(budget, sc.max_num_batched_tokens))
        self.variants = StepVariants(model, config, self.shapes, backend=self.backend, kv_caches=self.kv_caches,
                                     max_model_len=max_model_len, max_blocks_per_seq=self.max_blocks_per_seq,
                                     penalty_width=self.penalty_width, moe_layers=self.moe_layers, mesh=mesh,
                                     mm_slab=self.encoder.slab if self.encoder is not None else None,
                                     params=self.step_params, stages=stages,
                                     device_drafts=device_ngram_enabled(config))
        self.enforce_eager = self.variants.enforce_eager
        # n-gram speculation under async scheduling: drafts proposed on the device after every step (None: on
        # the host, or no n-gram speculation)
        self.ngram = DeviceNgram(config.speculative_config, max_model_len, self.max_num_seqs,
                                 self.variants.replicated) if self.variants.device_drafts else None
        self._step_count = 0
        # an M-RoPE family's 3-D positions (None: the positions stay 1-D)
        self.mrope = getattr(model.family, "mrope_positions", None)
        # each request's block-table row and sampling parameters, kept across steps
        self.input_batch = InputBatch(self.max_num_seqs, self.max_blocks_per_seq, self.vocab_size)
        # an EAGLE target (``StepVariants.hidden_rows``): its latest step's hidden states, which the proposer
        # reads (None until a step ran, and on every other runner)
        self.last_hidden: HiddenRows | None = None

    @property
    def step_params(self) -> dict:
        """The forward's weights: the model's, with LoRA on the adapter slots beside them."""
        params = self.model.params
        return params if self.lora is None else {**params, "lora": self.lora.stacks}

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Put a read adapter (``jaxserve.lora.LoRAAdapter``; None: zeros) in device slot ``slot``."""
        self.lora.write(slot, adapter)

    def bucket_for(self, num_tokens: int) -> int:
        return self.shapes.bucket_for(num_tokens)

    def prepare(self, scheduled, prev: PendingStep | None = None, *, pad_to_compiled: bool = True,
                spec_width: int = 0) -> step_inputs.ForwardInputs:
        """The forward's host arrays for ``scheduled`` (``step_inputs.forward_inputs``). ``pad_to_compiled``:
        while the step's own bucket is still compiling, pad up to a compiled one. ``spec_width``: a
        speculative step's K + 1 logits positions per request."""
        shape = self.shapes.own if not pad_to_compiled else \
            partial(self.variants.shape_for, spec=True) if spec_width else self.variants.shape_for
        return step_inputs.forward_inputs(scheduled, self.input_batch, self.block_size, shape,
                                          prev.rows if prev is not None else None, self.mrope, spec_width)

    # ---------------------------------------------------------------- step
    def dispatch(self, scheduled, prev: PendingStep | None = None, *, mm: bool = False,
                 spec: bool = False, hidden: tuple | None = None) -> PendingStep:
        """Build the inputs and launch the step; returns at once (JAX dispatches asynchronously). ``mm``: some
        chunk of the step holds image tokens (its new images are encoded first). ``spec``: some entry has
        draft tokens (``spec_token_ids``) to verify. ``hidden``: an EAGLE head's step, (the hidden states it
        reads, on the device; the row of them each of its tokens takes)."""
        step = self.dispatch_forward(scheduled, prev, mm=mm, spec=spec, hidden=hidden)
        return step if isinstance(step, PendingStep) else self.dispatch_sample(step)

    def dispatch_forward(self, scheduled, prev: PendingStep | None = None, *, mm: bool = False,
                         spec: bool = False, hidden: tuple | None = None) -> ForwardStep | PendingStep:
        """Launch the step's forward; the sampler follows with ``dispatch_sample`` (structured outputs fill
        their bitmask in between). A multi-step decode runs forward and sampler in one loop: it comes back
        as a PendingStep at once. ``spec``: a speculative step: the forward's logits at K + 1 positions per
        request, the rejection sampler after it."""
        t0 = time.perf_counter()
        v = self.variants
        multi = bool(v.decode_loops) and any(s.num_steps > 1 for s in scheduled)
        width = v.spec_width if spec else 0
        # a multi-step decode runs in its own bucket's loop (compiled on first use if need be)
        T, R, input_ids, positions, md, logits_idx, prev_index = self.prepare(scheduled, prev,
                                                                              pad_to_compiled=not multi,
                                                                              spec_width=width)
        self.stats.padded_tokens += T * (v.num_scheduler_steps if multi else 1)
        smeta = step_inputs.sampling_inputs(scheduled, self.input_batch, R, vocab_size=self.vocab_size,
                                            penalty_width=self.penalty_width, step=self._step_count,
                                            engine_seed=self.config.seed)
        prev_tokens = prev.tokens if prev is not None else v.no_prev
        limit = step_inputs.step_limits(scheduled, R) if multi else None
        lora = step_inputs.lora_slots(scheduled, T) if self.lora is not None else None
        shift = prev_rejected = draft_src = None
        ngram = self.ngram
        if width:       # rows placed as if the step in flight accepted all their drafts (async scheduling)
            shift_row = step_inputs.shift_rows(scheduled, R, prev.rows if prev is not None else None,
                                               prev.drafts if prev is not None else None)
            shift = {"shift_row": shift_row}
            if ngram is not None:   # the draft slots read the previous step's proposals on the device
                shift["draft_index"], draft_src = ngram.draft_sources(scheduled, input_ids, R)
            prev_rejected = prev.rejected if prev is not None and prev.rejected is not None else v.no_prev
        if ngram is not None:       # (this step's rows, before the forward: it may write new ones)
            ngram = (ngram.hist_rows(scheduled, R), ngram.drafts, ngram.counts)
        hidden_args, hidden_index = (), None
        if v.hidden_in:
            hidden_index = np.zeros(T, np.int32)
            hidden_index[:len(hidden[1])] = hidden[1]
            hidden_args = (None, None, None, hidden[0])
        f_ints, f_layout = forward_pack(input_ids, positions, md, logits_idx, prev_index, limit, lora, shift,
                                        hidden_index)
        logits = load = out_hidden = None
        mm_index = self._encode_images(scheduled, T) if mm or self.cross_attention else None
        if mm_index is not None:
            self.kv_caches, logits, *load = v.forward_mm_for(T)(self.step_params, self.kv_caches, f_ints,
                                                                prev_tokens, self.encoder.slab, mm_index)
            load = self._copy_load(load)
        elif limit is None:   # the forward first: the device starts on it while the host finishes the step
            # numpy in, so jit moves each buffer itself: 3 host-to-device copies, not ~24 (zero-copy on CPU)
            if width:
                self.kv_caches, logits, *load = v.forward_spec_for(T)(self.step_params, self.kv_caches, f_ints,
                                                                      prev_tokens, None, None, prev_rejected,
                                                                      *((None, ngram[1]) if ngram else ()))
            else:
                self.kv_caches, logits, *load = v.forward_for(T, md)(self.step_params, self.kv_caches, f_ints,
                                                                     prev_tokens, *hidden_args)
            if v.hidden_rows:
                out_hidden, *load = load
                self._record_hidden(scheduled, out_hidden)
            load = self._copy_load(load)
        s_fields, drafts = packing.fields(smeta), None
        if width:       # the rejection sampler's extra inputs: each row's drafts and their count
            s_fields["draft_ids"], s_fields["num_drafts"] = step_inputs.draft_arrays(scheduled, R, width - 1)
            s_fields["shift_row"] = shift["shift_row"]
            if draft_src is not None:
                s_fields["draft_src"] = draft_src
            drafts = {s.request.request_id: len(s.spec_token_ids) for s in scheduled if s.spec_token_ids}
        s_ints, s_floats, s_layout = packing.pack(s_fields)
        rows, lp_k, filtering = step_inputs.sampled_rows(scheduled, self.input_batch, v.static_sampling)
        key = (self.config.max_logprobs if lp_k else 0, filtering)
        if limit is None:
            return ForwardStep(logits, s_ints, s_floats, s_layout, key, rows, lp_k, int(md.query_start_loc[-1]), R,
                               (time.perf_counter() - t0) * 1e3, load, drafts, prev_rejected, out_hidden, ngram)
        # the scheduler gave each entry ``num_steps``: the loop's rows run that many
        loop_key = ("decode-loop", T, *key, s_layout)
        loop = v.get(loop_key) or v.need(loop_key, f"a multi-step decode of {T} tokens")
        self.kv_caches, out, padded, *load = loop(self.model.params, self.kv_caches, f_ints, prev_tokens, s_ints,
                                                  s_floats)
        load = self._copy_load(load)
        self._step_count += v.num_scheduler_steps
        n_tok, steps = int(limit[:len(scheduled)].sum()), {s.request.request_id: s.num_steps for s in scheduled}
        self.stats.host_ms += (time.perf_counter() - t0) * 1e3
        return PendingStep(out, padded, rows, lp_k, n_tok, steps, load)

    def _record_hidden(self, scheduled, hidden: jax.Array) -> None:
        """An EAGLE target's step: keep its hidden states and each request's rows (``last_hidden``)."""
        rows, row = [], 0
        for s in scheduled:
            rows.append((s.request, row, s.start_pos, s.num_new_tokens))
            row += s.num_new_tokens
        self.last_hidden = HiddenRows(hidden, rows)

    def _encode_images(self, scheduled, T: int) -> np.ndarray | None:
        """Encode the step's new images into the encoder cache; the decoder's image-row index (or None)."""
        new = [f for s in scheduled if s.encoder_inputs for f in s.encoder_inputs]
        if new:
            self.encoder.encode(new)
        return self.encoder.gather(scheduled, T)

    def free_encoder_outputs(self, hashes: list[str]) -> None:
        """Drop the encoder outputs the scheduler evicted."""
        self.encoder.free(hashes)

    @staticmethod
    def _copy_load(load: list) -> jax.Array | None:
        """The step's expert load (MoE), its copy to the host started now: ``collect`` then finds it there
        and waits on nothing but the sampled tokens."""
        if not load:
            return None
        load[0].copy_to_host_async()
        return load[0]

    def dispatch_sample(self, step: ForwardStep, bitmask: np.ndarray | None = None) -> PendingStep:
        """Launch the sampler of a dispatched forward; ``bitmask`` ([rows, bitmask_width] int32, structured
        outputs) selects the masked sampler variant."""
        t0 = time.perf_counter()
        kind = "sample" if step.drafts is None else "spec-sample"
        exe = self.variants.sampler_for((kind, *step.key, bitmask is not None, step.s_layout))
        rejected = None
        if step.drafts is not None:
            out, padded, rejected = exe(step.logits, step.s_ints, step.s_floats, bitmask, step.prev_rejected,
                                        *(step.ngram[1:] if step.ngram else ()))
        elif bitmask is None:
            out, padded = exe(step.logits, step.s_ints, step.s_floats)
        else:
            out, padded = exe(step.logits, step.s_ints, step.s_floats, bitmask)
        if self._to_driver is not None:
            out, padded = jax.device_put((out, padded), self._to_driver)
        proposed = None
        if step.ngram is not None:      # append the emitted tokens to the histories, propose the next drafts
            proposed = self.ngram.after_step(out, step.rows, step.ngram[0], step.drafts is not None)
            proposed.copy_to_host_async()
        self._step_count += 1
        self.stats.host_ms += step.t_host + (time.perf_counter() - t0) * 1e3
        return PendingStep(out, padded, step.rows, step.logprobs_k, step.num_tokens, None, step.expert_load,
                           step.drafts, rejected, step.hidden, proposed)

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a dispatched step and bring its sampled tokens (and logprobs) to the host."""
        t0 = time.perf_counter()
        out = pending.out
        token_ids = np.asarray(out.token_ids)
        lp = None
        if pending.logprobs_k:
            lp = (np.asarray(out.logprobs), np.asarray(out.ranks), np.asarray(out.topk_ids),
                  np.asarray(out.topk_logprobs))
        if pending.expert_load is not None:
            self.stats.expert_load.add(np.asarray(pending.expert_load))
        self.stats.count_step(pending.num_tokens, (time.perf_counter() - t0) * 1e3)
        rows, steps = pending.rows, pending.steps
        if pending.drafts is not None:
            res = self._spec_result(pending, token_ids, lp)
            if pending.proposed is not None:
                res.proposed = self.ngram.read_counts(pending.proposed, rows)
            return res

        def entry(at, k):   # (logprob, rank, top ids, top logprobs) at a row, or (iteration, row)
            return float(lp[0][at]), int(lp[1][at]), lp[2][at][:k].tolist(), lp[3][at][:k].tolist()
        if steps is None:
            toks = token_ids.tolist()
            res = StepResult({rid: toks[i] for rid, i in rows.items()}, {})
            for rid, k in pending.logprobs_k.items():
                res.logprobs[rid] = entry(rows[rid], k)
            if pending.proposed is not None:
                res.proposed = self.ngram.read_counts(pending.proposed, rows)
        else:               # multi-step: [steps, R] arrays, row i ran steps[rid] of them
            toks = token_ids.T.tolist()
            res = StepResult({rid: toks[i][:steps[rid]] for rid, i in rows.items()}, {})
            for rid, k in pending.logprobs_k.items():
                res.logprobs[rid] = [entry((j, rows[rid]), k) for j in range(steps[rid])]
        return res

    @staticmethod
    def _spec_result(pending: PendingStep, token_ids: np.ndarray, lp) -> StepResult:
        """A speculative step's result: a list of tokens for each request with drafts, a token for the others
        (whose logprobs, when asked, are those of the token drawn)."""
        counts = np.asarray(pending.out.num_tokens).tolist()
        verified = np.asarray(pending.out.num_drafts).tolist()
        toks = token_ids.tolist()
        res = StepResult({}, {}, {})
        for rid, i in pending.rows.items():
            d = pending.drafts.get(rid)
            if d:
                res.token_ids[rid] = toks[i][:counts[i]]
                res.spec[rid] = (d, counts[i] - 1, verified[i])
            else:
                res.token_ids[rid] = toks[i][0]
        for rid, k in pending.logprobs_k.items():
            i = pending.rows[rid]
            res.logprobs[rid] = float(lp[0][i]), int(lp[1][i]), lp[2][i][:k].tolist(), lp[3][i][:k].tolist()
        return res

    # ---------------------------------------------------------------- compiling (``step_variants``)
    def warmup(self, progress: bool = True, background: bool | None = None) -> float:
        """Compile the step variants (``StepVariants.warmup``) and a vision model's encoder batches."""
        seconds = self.variants.warmup(progress, background)
        if self.ngram is not None and not self.enforce_eager:
            t0 = time.perf_counter()
            self.ngram.warmup(self.variants._request_counts())
            seconds += time.perf_counter() - t0
        if self.encoder is not None and not self.enforce_eager:
            seconds += self.encoder.warmup()
        return seconds

    def warmup_for(self, prompt_lens: list[int]) -> float:
        return self.variants.warmup_for(prompt_lens)

    def _compilers(self) -> list:
        """The background compilers: the step variants', and a packed vision encoder's row batches."""
        return [self.variants] + ([self.encoder.compiler] if hasattr(self.encoder, "compiler") else [])

    def stop_background_compiles(self, wait: bool = False) -> None:
        """Drop the queued background compiles (a one-shot run); a variant a step needs still compiles.
        ``wait``: also for the compiles in progress, after which no compile thread holds this runner."""
        for c in self._compilers():
            c.stop(wait=wait)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compiles are done (False on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(c.wait_all(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for c in self._compilers())

    def pending_compiles(self) -> int:
        """Background compiles queued or running (the step variants' and the encoder's)."""
        return sum(c.pending() for c in self._compilers())

    def compiled_variants(self) -> int:
        """How many executables exist (the no-recompilation test compares this before and after a workload)."""
        return len(self.variants)
