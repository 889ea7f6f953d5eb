"""The step's executables: what each compiled variant is, which one a step runs, and what compiles when.

A step is two jitted calls dispatched back to back with no host sync between them: the model forward over
the flat ragged token list (prefill chunks and decode tokens together) returning logits for each request's
last token, then the on-device sampler. Splitting them keeps the expensive model executable to one per
token bucket (the sampler's variants — logprobs on/off, penalties on/off, a structured-output bitmask or
none — are small graphs), and lets a structured-output step fill its bitmask on the host while the forward
runs. The request count follows the token bucket, and the KV cache is donated so XLA updates it in place.
Multi-step decoding adds a third executable per decode bucket (``multi_step``).

A variant's key:
- ``("forward", T, decode_only[, SHORT_SEQ_LEN])``: the forward over a bucket of T tokens;
- ``("forward-mm", T)``: a vision model's forward of a step with image tokens (their embeddings gathered
  from the encoder cache's slab over up to T rows), compiled in the background after the text variants; a
  step without image tokens runs the plain forward;
- ``("sample", num_logprobs, filtering, masked, s_layout)``: the sampler for ``s_layout``'s request count;
- ``("decode-loop", T, num_logprobs, filtering, s_layout)``: a multi-step decode;
- speculative decoding: ``("forward-spec", T, width)``, the forward returning logits at ``width`` (K + 1)
  positions per request, and ``("spec-sample", num_logprobs, filtering, masked, s_layout)``, the rejection
  sampler (``rejection_sampler``); compiled in the background after the others (a speculative step pads up
  to a compiled one, as a plain step does, and compiles its own only when none is).

Compiling (``StepCompiler``, which this class is): every executable is compiled ahead of time and called
directly, so a step never compiles silently. ``warmup`` compiles what the first steps need (the smallest
bucket for decodes and the largest, which any step fits in, with their base samplers) concurrently, returns —
the engine can answer — and the other buckets compile on background threads; until a step's own bucket is
compiled it pads up to the next compiled one (``route``). Sampler variants that only some requests need
(logprobs, penalties, a structured-output bitmask) compile when the first such request arrives (it waits)
and then for the other request counts in the background. ``--enforce-eager`` compiles nothing ahead: each
variant on first use. A variant is lowered from its stored program (``program_cache``) when one matches.
"""
from __future__ import annotations

import logging
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.config_decoding import HIDDEN_STATE_METHODS
from jaxserve.kernels import ops as kernel_ops
from jaxserve.kernels.metadata import SHORT_SEQ_LEN, AttentionMetadata
from jaxserve.models.eagle_loader import aux_layer_ids
from jaxserve.parallel import bind_mesh, kv_heads_per_device, tp_size
from jaxserve.runner import packing, program_cache, sampler as sampler_mod, step_inputs
from jaxserve.runner.multi_step import decode_loop_fn
from jaxserve.runner.rejection_sampler import spec_sample_fn
from jaxserve.runner.step_compiler import StepCompiler
from jaxserve.runner.step_functions import forward_fn, sample_fn
from jaxserve.runner.step_inputs import StepShapes
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepVariants(StepCompiler):
    """The step's executables by key: a ``StepCompiler`` that knows what each key is and how to lower it."""

    def __init__(self, model, config: EngineConfig, shapes: StepShapes, *, backend: str, kv_caches,
                 max_model_len: int, max_blocks_per_seq: int, penalty_width: int, moe_layers, mesh=None,
                 mm_slab=None, params=None, stages=None, device_drafts: bool = False):
        super().__init__(self.lower)
        self.cfg, self.shapes, self.mesh = model.config, shapes, mesh
        self.max_model_len, self.max_blocks_per_seq = max_model_len, max_blocks_per_seq
        self.mrope = hasattr(model.family, "mrope_positions")       # the step's positions are [3, T]
        # image steps carry each token's attend limit (``encoder_cache.EncoderCache.gather``)
        self.bidirectional_images = getattr(model.family, "bidirectional_images", False)
        self.penalty_width = penalty_width
        self.vocab_size = self.cfg.vocab_size
        self.enforce_eager = config.enforce_eager or config.skip_warmup
        max_num_seqs, max_logprobs = shapes.max_num_seqs, config.max_logprobs
        # EAGLE (``engine.eagle_proposer``): the target's forwards also return every token row's hidden state
        # and the head's take theirs as an input, padded to the largest bucket (one shape whatever the bucket)
        self.hidden_in = getattr(model.family, "takes_hidden", False)
        method = getattr(config.speculative_config, "method", None)
        self.hidden_rows = shapes.sizes[-1] if self.hidden_in or method in HIDDEN_STATE_METHODS else 0
        # EAGLE-3: the target's are its auxiliary layers' residual streams side by side, and its head's as wide
        self.aux_layers = aux_layer_ids(config.speculative_config.model, self.cfg) if method == "eagle3" else ()
        self.hidden_width = model.family.hidden_width(self.cfg) if self.hidden_in else \
            max(len(self.aux_layers), 1) * self.cfg.hidden_size
        # Under a mesh every step output has a declared sharding (the cache's own, the rest replicated), and
        # the executables are compiled for the same shardings in: a step fed what an earlier step returned
        # runs the executable compiled ahead (one called with other shardings raises: never a recompile).
        rep, fwd_out, samp_out, loop_out = None, {}, {}, {}
        if mesh is not None:
            from jaxserve.parallel import kv_cache_sharding, replicated
            rep = replicated(mesh)
            kv_sh = kv_cache_sharding(mesh, self.cfg)
            load_out = (rep,) if moe_layers else ()
            fwd_out = {"out_shardings": (kv_sh, rep, *((rep,) if self.hidden_rows else ()), *load_out)}
            samp_out = {"out_shardings": rep}
            loop_out = {"out_shardings": (kv_sh, rep, rep, *load_out)}
        self.replicated = rep
        # what each kind's jit is given besides its static arguments (a stored program's call gets the same)
        self._jit_kwargs = {"forward": {"donate_argnums": (1,), **fwd_out},
                            "forward-mm": {"donate_argnums": (1,), **fwd_out}, "sample": samp_out,
                            "forward-spec": {"donate_argnums": (1,), **fwd_out}, "spec-sample": samp_out,
                            "decode-loop": {"donate_argnums": (1,), **loop_out}}
        # bind_mesh: the forward traces under the mesh so attention runs in shard_map over "tp"
        self.forward = jax.jit(bind_mesh(partial(forward_fn, model.family, self.cfg, backend, moe_layers,
                                                 block_size=config.cache.block_size, hidden_rows=self.hidden_rows,
                                                 hidden_width=self.hidden_width, aux_layers=self.aux_layers),
                                         mesh), static_argnames=("layout", "decode_only", "max_seq_len"),
                               **self._jit_kwargs["forward"])
        # Decode-only steps whose contexts are all within SHORT_SEQ_LEN get one more variant where it changes the
        # attention's launch: one decode launch instead of flash-decoding splits sized for max_model_len and
        # their combine (the splits a batch-1 step takes at short context cost a launch a layer; MLA's kernel
        # splits such a step too, but into fewer, shorter splits). Compiled in
        # the background; until then (or past the bound) a step runs the ordinary decode-only variant.
        self.short_decode = shapes.uniform_decode and max_model_len > SHORT_SEQ_LEN
        # On GPU the sampler must not contain XLA conditionals (each one syncs the host with the device), so
        # the host says whether any row filters (top-k/top-p): two static variants. CPU keeps lax.cond.
        self.static_sampling = jax.default_backend() != "cpu"
        filter_modes = (False, True) if self.static_sampling else (None,)
        self.samplers = {(nl, f): jax.jit(partial(sample_fn, nl, max_num_seqs, f), static_argnames=("layout",),
                                          **samp_out)
                         for nl in (0, max_logprobs) for f in filter_modes}
        # speculative decoding (--speculative-config): the K + 1 positions each request verifies per step
        spec = config.speculative_config
        self.spec_width = spec.num_speculative_tokens + 1 if spec is not None else 0
        # n-gram drafts proposed on the device (``ngram_device``): the speculative variants read them there
        self.device_drafts = device_drafts
        self.spec_samplers = {(nl, f): jax.jit(partial(spec_sample_fn, nl, max_num_seqs, f),
                                               static_argnames=("layout",), **samp_out)
                              for nl in (0, max_logprobs) for f in filter_modes} if spec is not None else {}
        # a structured-output step passes its bitmask to the same jitted samplers: a separate executable
        # (another input signature), so a step without constrained rows runs exactly the unmasked program
        tokenizer = getattr(model, "tokenizer", None)
        self.bitmask_width = (max(self.vocab_size, len(tokenizer) if tokenizer is not None else 0) + 31) // 32
        # made where step outputs are (replicated on the mesh: made there, not copied there, as a copy onto a
        # mesh spanning processes would first check every process holds the same value)
        self.no_prev = jnp.zeros(max_num_seqs, jnp.int32) if rep is None else \
            jnp.zeros(max_num_seqs, jnp.int32, device=rep)
        # pipeline stages (``runner.pipeline``): a forward key compiles one program per stage; ``mesh`` is the
        # last stage's, where the logits and so the samplers are
        self.pipeline = None
        if stages is not None:
            from jaxserve.runner.pipeline import PipelinePlan  # noqa: PLC0415
            self.pipeline = PipelinePlan(model, stages, forward_fn, backend)
            self.no_prev = jnp.zeros(max_num_seqs, jnp.int32, device=self.pipeline.stages.replicated(0))
        # multi-step decoding (--num-scheduler-steps): one decode loop per (token bucket, logprobs, filter mode)
        self.num_scheduler_steps = config.scheduler.num_scheduler_steps
        self.decode_loops = {}
        if self.num_scheduler_steps > 1:
            self.decode_loops = {
                (nl, f): jax.jit(bind_mesh(partial(decode_loop_fn, model.family, self.cfg, backend, max_num_seqs,
                                                   config.cache.block_size, self.num_scheduler_steps, nl, f,
                                                   moe_layers), mesh),
                                 static_argnames=("layout", "s_layout"), **self._jit_kwargs["decode-loop"])
                for nl in (0, max_logprobs) for f in filter_modes}
        # what the executables are compiled for: shapes, dtypes and shardings only (a background compile must
        # not touch the cache buffers a step is donating meanwhile)
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))  # noqa: E731
        # ``params``: the step's weights (the model's, and with LoRA the adapter slots beside them)
        self._param_specs = jax.tree.map(spec, model.params if params is None else params)
        self.lora = params is not None and "lora" in params
        self._kv_specs = jax.tree.map(spec, kv_caches)
        self._prev_spec = spec(self.no_prev)
        # the previous step's device proposals, flat [max_num_seqs * K] (``ngram_device``)
        self._drafts_spec = jax.ShapeDtypeStruct((max_num_seqs * max(self.spec_width - 1, 0),), jnp.int32,
                                                 sharding=rep) if device_drafts else None
        self._hidden_spec = jax.ShapeDtypeStruct((self.hidden_rows, self.hidden_width), model.dtype,
                                                 sharding=rep) if self.hidden_in else None
        # the variants' exported programs (a warm start lowers them without tracing the model)
        from jaxserve.parallel import collectives
        self.programs = program_cache.ProgramCache(
            program_cache.directory_for(jax.config.jax_compilation_cache_dir),
            context=f"mesh {mesh!r}; custom all-reduce {collectives._enabled} fused norm {collectives.fuses_norm()}")
        # (exact bucket, decode-only) -> the compiled (bucket, decode-only) a step of that size runs in now;
        # rebuilt whenever more executables are ready
        self._routes: dict[tuple[int, bool], tuple[int, bool]] = {}
        self._routes_at = -1
        # a vision model's encoder slab, as the forward-mm variants read it (None: a text model)
        self._mm_slab_spec = None if mm_slab is None else jax.tree.map(spec, mm_slab)
        self.family, self.cross_attention = model.family, getattr(model.family, "cross_attention", False)

    # ---------------------------------------------------------------- which executable a step runs
    def shape_for(self, num_tokens: int, all_decode: bool, spec: bool = False) -> tuple[int, int, bool]:
        """A step's compiled shape (T, R, decode-only): ``StepShapes.own``, routed to a compiled variant
        (``spec``: a speculative step's forward, never decode-only)."""
        s = self.shapes
        T, decode_only = self.route(s.bucket_for(num_tokens), s.uniform_decode and all_decode and not spec, spec)
        return T, s.num_reqs_for(T), decode_only

    def route(self, T: int, decode_only: bool, spec: bool = False) -> tuple[int, bool]:
        """The compiled forward a step of bucket ``T`` runs in: its own, else (during start-up) the next
        larger compiled bucket, the decode-only variant where there is one (``spec``: of the speculative
        forwards). Nothing compiled at or above ``T`` (``--enforce-eager``): its own, which the step then
        compiles."""
        if self._routes_at != len(self):
            self._routes_at = len(self)
            self._routes = {}
            sizes = self.shapes.sizes
            for b in sizes:
                for dec in (False, True):
                    for c in (c for c in sizes if c >= b):
                        if dec and ("forward", c, True) in self:
                            self._routes[b, dec] = (c, True)
                            break
                        if ("forward", c, False) in self:
                            self._routes[b, dec] = (c, False)
                            break
                spec_c = next((c for c in sizes if c >= b and ("forward-spec", c, self.spec_width) in self),
                              None) if self.spec_width else None
                if spec_c is not None:
                    self._routes[b, "spec"] = (spec_c, False)
        return self._routes.get((T, "spec" if spec else decode_only), (T, decode_only))

    def forward_for(self, T: int, md: AttentionMetadata):
        """The forward a step of bucket ``T`` runs: the short-context decode variant when the step's contexts
        all fit it and it is compiled, else its own (compiled now if need be)."""
        fwd = md.decode_only and self.short_decode and int(md.seq_lens.max(initial=0)) <= SHORT_SEQ_LEN \
            and self.get(("forward", T, True, SHORT_SEQ_LEN))
        return fwd or self.get(("forward", T, md.decode_only)) or \
            self.need(("forward", T, md.decode_only), f"a step of {T} tokens")

    def forward_mm_for(self, T: int):
        """The forward of a step of bucket ``T`` with image tokens (compiled now if need be)."""
        key = ("forward-mm", T)
        return self.get(key) or self.need(key, f"a step of {T} tokens with image tokens")

    def forward_spec_for(self, T: int):
        """The speculative forward of bucket ``T`` (compiled now if need be)."""
        key = ("forward-spec", T, self.spec_width)
        return self.get(key) or self.need(key, f"a speculative step of {T} tokens")

    def sampler_for(self, key):
        """A sampler variant; one no step has needed yet (logprobs, penalties, a bitmask, ...) is compiled now
        for this request count (the step waits), then for the other request counts in the background."""
        exe = self.get(key)
        if exe is not None:
            return exe
        _, num_logprobs, filtering, masked, s_layout = key
        exe = self.need(key, "the first step that needs it")
        if not self.enforce_eager:
            R = s_layout[0].shape[0]
            self.submit([(key[0], num_logprobs, filtering, masked, _with_rows(s_layout, R, r))
                         for r in self._request_counts() if r != R], priority=2)
        return exe

    # ---------------------------------------------------------------- lowering
    def padding_inputs(self, T: int, multi_step: bool = False, spec_width: int = 0):
        """A step of bucket ``T``'s packed forward inputs (padding only) and their layout (``spec_width``: a
        speculative step's, logits at that many positions per request)."""
        R = self.shapes.num_reqs_for(T)
        _, _, *x = step_inputs.padding(T, R, self.max_blocks_per_seq,
                                       mrope=self.mrope)
        shift = None
        if spec_width:
            x[3] = np.zeros(R * spec_width, np.int32)
            shift = {"shift_row": np.full(R, -1, np.int32)}
            if self.device_drafts:
                shift["draft_index"] = np.full(T, -1, np.int32)
        return step_inputs.forward_pack(*x, np.ones(R, np.int32) if multi_step else None,
                                        np.zeros(T, np.int32) if self.lora else None, shift,
                                        np.zeros(T, np.int32) if self.hidden_in else None)

    def _sampler_layout(self, R: int, penalized: bool = False) -> packing.Layout:
        """The packed sampling metadata's layout for ``R`` rows: what every step without penalties ships
        (``penalized``: some row uses a penalty: the history arrays at ``penalty_width``)."""
        plist = [SamplingParams(repetition_penalty=1.1)] if penalized else []
        smeta = sampler_mod.make_sampling_metadata(
            plist, [[]] * len(plist), [[0]] * len(plist), [0] * len(plist), self.vocab_size, pad_to=R,
            request_seeds=[0] * len(plist), penalty_width=self.penalty_width)
        return packing.pack(packing.fields(smeta))[2]

    def _spec_layout(self, R: int) -> packing.Layout:
        """The speculative sampler's packed layout for ``R`` rows (no penalties): the sampling metadata, then
        the drafts and their counts."""
        smeta = sampler_mod.make_sampling_metadata([], [], [], [], self.vocab_size, pad_to=R,
                                                   penalty_width=self.penalty_width)
        drafts, counts = step_inputs.draft_arrays([], R, self.spec_width - 1)
        device = {"draft_src": np.full(R, -1, np.int32)} if self.device_drafts else {}
        return packing.pack({**packing.fields(smeta), "draft_ids": drafts, "num_drafts": counts,
                             "shift_row": np.full(R, -1, np.int32), **device})[2]

    @staticmethod
    def _buffers(layout: packing.Layout) -> tuple[np.ndarray, np.ndarray]:
        """Zero int32 and float32 buffers of ``layout``'s sizes (what ``packing.pack`` would return)."""
        n_f = sum(math.prod(p.shape) for p in layout if p.kind == "f32")
        n_i = sum(math.prod(p.shape) for p in layout) - n_f
        return np.zeros(n_i, np.int32), np.zeros(n_f, np.float32)

    def lower(self, key):
        """Trace and lower one executable (``StepCompiler`` compiles it): from shapes, not buffers; from its
        stored program when ``self.programs`` has it."""
        kind = key[0]
        if kind == "forward":
            _, T, decode_only, *bound = key       # ("forward", T, True, SHORT_SEQ_LEN): short-context decodes
            ints, layout = self.padding_inputs(T)
            # (an EAGLE head's: no mm slab, index or rejected drafts; the hidden states it gathers from)
            hidden = (None, None, None, self._hidden_spec) if self.hidden_in else ()
            fn, args = self.forward, (self._param_specs, self._kv_specs, ints, self._prev_spec, *hidden)
            static = {"layout": layout, "decode_only": decode_only, "max_seq_len": bound[0] if bound else None}
            if self.pipeline is not None:
                return self.pipeline.lower(self._param_specs, self._kv_specs, ints, self._prev_spec, static)
        elif kind == "forward-mm":
            _, T = key
            ints, layout = self.padding_inputs(T)
            rows = self.family.cross_index_rows(self.cfg) if self.cross_attention else \
                3 if self.bidirectional_images else 2
            index = jax.ShapeDtypeStruct((rows, T), jnp.int32)
            fn = self.forward
            args = (self._param_specs, self._kv_specs, ints, self._prev_spec, self._mm_slab_spec, index)
            static = {"layout": layout, "decode_only": False, "max_seq_len": None}
        elif kind == "forward-spec":
            _, T, width = key
            ints, layout = self.padding_inputs(T, spec_width=width)
            fn, args = self.forward, (self._param_specs, self._kv_specs, ints, self._prev_spec, None, None,
                                      self._prev_spec, *((None, self._drafts_spec) if self.device_drafts else ()))
            static = {"layout": layout, "decode_only": False, "max_seq_len": None}
        elif kind in ("sample", "spec-sample"):
            _, num_logprobs, filtering, masked, s_layout = key
            R = s_layout[0].shape[0]
            rows = R * self.spec_width if kind == "spec-sample" else R
            logits = jax.ShapeDtypeStruct((rows, self.vocab_size), jnp.float32, sharding=self.replicated)
            extra = (np.zeros((R, self.bitmask_width), np.int32),) if masked else ()
            if kind == "spec-sample":       # (the bitmask, or None; the previous step's rejected counts)
                extra = (extra[0] if masked else None, self._prev_spec)
                if self.device_drafts:      # (its device proposals and their counts)
                    extra += (self._drafts_spec, self._prev_spec)
            samplers = self.spec_samplers if kind == "spec-sample" else self.samplers
            fn, args = samplers[num_logprobs, filtering], (logits, *self._buffers(s_layout), *extra)
            static = {"layout": s_layout}
        elif kind == "decode-loop":
            _, T, num_logprobs, filtering, s_layout = key
            ints, layout = self.padding_inputs(T, multi_step=True)
            fn = self.decode_loops[num_logprobs, filtering]
            args = (self._param_specs, self._kv_specs, ints, self._prev_spec, *self._buffers(s_layout))
            static = {"layout": layout, "s_layout": s_layout}
        else:
            raise KeyError(key)
        return self.programs.lower(key, fn, args, static, **self._jit_kwargs[kind])

    # ---------------------------------------------------------------- what compiles when
    def _request_counts(self) -> list[int]:
        return sorted({self.shapes.num_reqs_for(T) for T in self.shapes.sizes})

    def planned(self) -> tuple[list, list]:
        """The executables compiled ahead: (what the first steps need, the rest, in the order wanted).

        First: the smallest bucket (a batch of decodes) and the largest (a step of any size pads up to it),
        with the sampler every request without logprobs, penalties or a grammar uses. Then the other buckets
        from the smallest up (decodes are the steps that run most), then the filtering samplers (GPU:
        requests with top-k/top-p). Logprobs, penalties and bitmasks compile on first use."""
        s = self.shapes
        base_f = False if self.static_sampling else None
        decode_cap = s.bucket_for(min(s.max_num_seqs, s.sizes[-1]))

        def bucket(T):
            ks = [("sample", 0, base_f, False, self._sampler_layout(s.num_reqs_for(T)))]
            if s.uniform_decode and T <= decode_cap:
                ks.append(("forward", T, True))
            ks.append(("forward", T, False))
            if self.decode_loops and T <= decode_cap:
                ks.append(("decode-loop", T, 0, base_f, self._sampler_layout(s.num_reqs_for(T))))
            return ks
        first = bucket(s.sizes[0]) + bucket(s.sizes[-1])
        rest = [k for T in s.sizes[1:-1] for k in bucket(T)]
        if self.short_decode:   # after the rest: a step runs correctly without them, only slower
            kvh = kv_heads_per_device(self.cfg, tp_size(self.mesh))
            rest += [("forward", T, True, SHORT_SEQ_LEN) for T in s.sizes if T <= decode_cap and
                     kernel_ops.decode_splits(s.num_reqs_for(T), kvh, SHORT_SEQ_LEN)
                     < kernel_ops.decode_splits(s.num_reqs_for(T), kvh, self.max_model_len)]
        if self._mm_slab_spec is not None:      # a vision model: its image steps, after the text ones
            rest += [("forward-mm", T) for T in s.sizes]
        if self.spec_width:     # speculative steps' buckets and samplers (one pads up to a compiled one)
            rest += [k for T in s.sizes for k in (
                ("forward-spec", T, self.spec_width),
                ("spec-sample", 0, base_f, False, self._spec_layout(s.num_reqs_for(T))))]
        if self.static_sampling:
            rest += [("sample", 0, True, False, self._sampler_layout(r)) for r in self._request_counts()]
            if self.decode_loops:
                rest += [("decode-loop", T, 0, True, self._sampler_layout(s.num_reqs_for(T)))
                         for T in s.sizes if T <= decode_cap]
        first = list(dict.fromkeys(first))
        return first, [k for k in dict.fromkeys(rest) if k not in first]

    def warmup(self, progress: bool = True, background: bool | None = None) -> float:
        """Compile what the first steps need (concurrently) and queue the other planned variants for the
        background threads (``background=False``: compile them all now, as every process of a multi-process
        mesh must, to take the same bucket for the same step). Returns the seconds it blocked.
        ``--enforce-eager``: nothing."""
        t0 = time.perf_counter()
        if self.enforce_eager:
            return 0.0
        if background is None:
            background = jax.process_count() == 1
        first, rest = self.planned()
        if not background:
            first, rest = first + rest, []
        self.compile_now(first)
        if progress:
            logger.info("compiled %d step variants in %.1f s; %d more compile in the background", len(first),
                        time.perf_counter() - t0, len(rest))
        self.submit(rest, priority=1)
        return time.perf_counter() - t0

    def warmup_for(self, prompt_lens: list[int]) -> float:
        """A one-shot run that knows its prompts (``jaxserve generate``): compile, concurrently, what its
        steps will run — the first step's prefill bucket and the decode bucket of its requests, each with
        its sampler — and nothing else (no background compiles to outlive the run). A step that needs
        another bucket pads up to one of these or compiles it then. Returns the seconds it blocked."""
        t0 = time.perf_counter()
        if not prompt_lens:
            return 0.0
        s = self.shapes
        base_f = False if self.static_sampling else None
        n = min(len(prompt_lens), s.max_num_seqs)
        prefill = s.bucket_for(min(sum(prompt_lens[:n]), s.sizes[-1]))
        decode = s.bucket_for(min(n, s.sizes[-1]))
        keys = [("sample", 0, base_f, False, self._sampler_layout(s.num_reqs_for(T))) for T in (prefill, decode)]
        keys += [("forward", prefill, False), ("forward", decode, s.uniform_decode)]
        if self.decode_loops:
            keys.append(("decode-loop", decode, 0, base_f, self._sampler_layout(s.num_reqs_for(decode))))
        self.compile_now(keys)
        return time.perf_counter() - t0


def _with_rows(layout: packing.Layout, old: int, new: int) -> packing.Layout:
    """A sampler layout for ``new`` rows instead of ``old`` (every per-row piece's leading axis)."""
    return tuple(p._replace(shape=(new, *p.shape[1:])) if p.name != "engine_key_data" and p.shape[:1] == (old,)
                 else p for p in layout)
