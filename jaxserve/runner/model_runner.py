"""The device side of a step: padded arrays from a scheduler decision, the jitted step, warm-up.

A step is two jitted calls dispatched back to back with no host sync between them: the model forward over
the flat ragged token list (prefill chunks and decode tokens together) returning logits for each request's
last token, then the on-device sampler. Splitting them keeps the expensive model executable to one per
token bucket (the sampler's variants — logprobs on/off, penalties on/off, a structured-output bitmask or
none — are small graphs), and lets a structured-output step fill its bitmask on the host while the forward
runs (``dispatch_forward``, then ``dispatch_sample`` with the mask). The request
count follows the token bucket, and the KV cache is donated so XLA updates it in place.

Compiling (``step_compiler``): every executable is compiled ahead of time and called directly, so a step
never compiles silently. ``warmup`` compiles what the first steps need (the smallest bucket for decodes and
the largest, which any step fits in, with their base samplers) concurrently, returns — the engine can
answer — and the other buckets compile on background threads; until a step's own bucket is compiled it pads
up to the next compiled one. Sampler variants that only some requests need (logprobs, penalties, a
structured-output bitmask) compile when the first such request arrives (it waits) and then for the other
request counts in the background. ``--enforce-eager`` compiles nothing ahead: each variant on first use.

Multi-step decoding (``--num-scheduler-steps N``) adds a third executable per decode bucket: N iterations of
forward → sample → feed the token back in one ``lax.fori_loop``, for steps whose requests all decode.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from functools import partial
from itertools import chain

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kernels import ops as kernel_ops
from jaxserve.runner.step_contract import PLACEHOLDER
from jaxserve.kernels.metadata import PAD_SLOT, SHORT_SEQ_LEN, AttentionMetadata
from jaxserve.parallel import bind_mesh, gather_logits, kv_heads_per_device, tp_size
from jaxserve.runner import device_memory, packing, program_cache, sampler as sampler_mod
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.program_cache import ProgramCache
from jaxserve.runner.step_compiler import StepCompiler
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The smallest default token bucket: a batch-1 decode step pads to it. Smaller buckets decoded faster on the
# H200 down to 4 (8 beat 16 for Llama-3.1-8B at TP=1 and TP=2, 4 beat 8 for Llama-3.2-1B); a bucket of 1 was
# about 10x slower: with one token row XLA turns some of the step's matmuls into multiply + reduce fusions.
# Below 4 warns on GPU.
MIN_TOKEN_BUCKET = 4


def token_buckets(max_num_batched_tokens: int, smallest: int = MIN_TOKEN_BUCKET) -> list[int]:
    """``smallest``, 2×, 4×, ... below the budget, then the budget itself (the last bucket is exactly it).
    The runner's token buckets and the embedder's batch and length buckets."""
    out, b = [], smallest
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    out.append(max_num_batched_tokens)
    return out


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


# vLLM's iteration_tokens_total histogram bounds: the tokens one step computes
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclasses.dataclass(slots=True)
class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, summed over steps (``tokens [L_moe, E]``), and per
    step and layer the busiest expert's count and the mean count, summed: over a window, their ratio
    mean / max is vLLM's EPLB "balancedness" (1 when every expert gets the same tokens). The counts come from
    the step's forward itself, copied to the host beside its sampled tokens."""
    tokens: np.ndarray
    max_sum: float = 0.0
    mean_sum: float = 0.0

    def add(self, counts: np.ndarray) -> None:
        """One step's ``[L_moe, E]`` counts (a multi-step dispatch: ``[steps, L_moe, E]``)."""
        self.tokens += counts if counts.ndim == 2 else counts.sum(axis=0)
        self.max_sum += float(counts.max(axis=-1).sum())
        self.mean_sum += float(counts.sum()) / counts.shape[-1]

    def snapshot(self) -> dict:
        return {"moe_layers": self.tokens.shape[0], "moe_expert_tokens_total": self.tokens.sum(axis=0).tolist(),
                "moe_max_expert_tokens_total": self.max_sum, "moe_mean_expert_tokens_total": self.mean_sum,
                "moe_expert_balancedness": self.mean_sum / self.max_sum if self.max_sum else 1.0}


@dataclasses.dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    host_ms: float = 0.0        # building inputs + dispatch, summed
    device_ms: float = 0.0      # waiting for the step's results, summed
    tokens: int = 0
    # steps by tokens computed: [i] counts steps of at most ITERATION_TOKEN_BUCKETS[i] tokens (the last: more)
    token_buckets: list = dataclasses.field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    expert_load: ExpertLoad | None = None       # MoE models

    def snapshot(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "host_ms_per_step": self.host_ms / n,
                "device_ms_per_step": self.device_ms / n, "tokens_per_step": self.tokens / n,
                "iteration_tokens": (ITERATION_TOKEN_BUCKETS, tuple(self.token_buckets), self.tokens),
                **(self.expert_load.snapshot() if self.expert_load is not None else {})}


def _moe_layers(model) -> tuple[int, int] | None:
    """(MoE layers, experts) of a mixture-of-experts decoder, else None."""
    spec = getattr(model.family, "decoder_spec", None)
    moe = spec(model.config).moe if spec is not None else None
    return (sum(moe.layers), moe.num_experts) if moe is not None else None


def _forward_fn(family, cfg, backend, expert_load, params, kv_caches, ints, prev_tokens, *, layout,
                decode_only=False, max_seq_len=None):
    # The step's int32 inputs arrive packed in one buffer (one host-to-device copy; ``packing``).
    x = packing.unpack(ints, None, layout)
    md = AttentionMetadata(**packing.take(x, "md."), decode_only=decode_only, max_seq_len=max_seq_len)
    input_ids, positions, logits_indices, prev_index = x["input_ids"], x["positions"], x["logits_idx"], \
        x["prev_index"]
    # Tokens sampled by the previous step never visit the host before this step runs: the host marks them
    # PLACEHOLDER and ``prev_index`` says which row of the previous step's (padded) output holds each one.
    input_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    hidden, kv_caches, load = family.forward_with_expert_load(params, kv_caches, input_ids, positions, md, cfg,
                                                              attn_backend=backend) if expert_load else \
        (*family.forward(params, kv_caches, input_ids, positions, md, cfg, attn_backend=backend), None)
    # under a tp mesh: vocab-sharded logits gathered once ([R, vocab]) for the sampler
    logits = gather_logits(family.compute_logits(params, hidden[logits_indices], cfg))
    return (kv_caches, logits, load) if expert_load else (kv_caches, logits)


def _sample_fn(num_logprobs, max_rows, filtering, logits, ints, floats, bitmask=None, *, layout):
    sampling_meta = sampler_mod.SamplingMetadata(**packing.unpack(ints, floats, layout))
    out = sampler_mod.sample(logits, sampling_meta, num_logprobs=num_logprobs, filtering=filtering,
                             bitmask=bitmask)
    # the sampled ids padded to a fixed length, so the next step's forward sees one shape whatever this bucket
    padded = jnp.zeros(max_rows, jnp.int32).at[:out.token_ids.shape[0]].set(out.token_ids)
    return out, padded


def _decode_loop_fn(family, cfg, backend, max_rows, block_size, num_steps, num_logprobs, filtering, moe_layers,
                    params, kv_caches, ints, prev_tokens, s_ints, s_floats, *, layout, s_layout):
    """Multi-step decoding: ``num_steps`` iterations of forward → sample → feed the token back, as one
    device-side loop (XLA's while loop with a known trip count: no host round trip between iterations).

    Every request decodes (token row i = request row i). Row i runs ``step_limit[i]`` iterations; after
    that it repeats its last position with its K/V write sent to the null block (PAD_SLOT), so an early
    finisher never writes outside the blocks the scheduler gave it. Returns the cache, a SamplerOutput whose
    arrays have a leading [num_steps] axis (ids, and the logprobs when ``num_logprobs`` asks for them) and
    each row's last real token (padded to ``max_rows``: what the next step's placeholders read); for an MoE
    model (``moe_layers``: (layers, experts)) each iteration's expert load too, ``[num_steps, L_moe, E]``."""
    x = packing.unpack(ints, None, layout)
    md = AttentionMetadata(**packing.take(x, "md."), decode_only=True)
    prev_index = x["prev_index"]
    ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], x["input_ids"])
    meta = sampler_mod.SamplingMetadata(**packing.unpack(s_ints, s_floats, s_layout))
    T, R = ids.shape[0], md.seq_lens.shape[0]
    limit = x["step_limit"]                                   # [R], 1 on padding rows
    tok_row = jnp.minimum(jnp.arange(T), R - 1)
    real = jnp.arange(T) < md.num_seqs
    positions0, logits_idx = x["positions"], x["logits_idx"]

    def body(i, carry):
        kv, ids, outs, loads = carry
        advance = jnp.minimum(i, limit - 1)                  # [R]
        pos = positions0 + advance[tok_row]
        slot = md.block_tables[tok_row, pos // block_size] * block_size + pos % block_size
        slot = jnp.where(real & (i < limit[tok_row]), slot, PAD_SLOT)
        step_md = dataclasses.replace(md, slot_mapping=slot, seq_lens=md.seq_lens + advance)  # padding: +0
        hidden, kv, load = family.forward_with_expert_load(params, kv, ids, pos, step_md, cfg,
                                                           attn_backend=backend) if moe_layers else \
            (*family.forward(params, kv, ids, pos, step_md, cfg, attn_backend=backend), None)
        if moe_layers:
            loads = loads.at[i].set(load)
        logits = gather_logits(family.compute_logits(params, hidden[logits_idx], cfg))
        step_meta = dataclasses.replace(meta, key_counter=meta.key_counter + i.astype(jnp.uint32))
        out = sampler_mod.sample(logits, step_meta, num_logprobs=num_logprobs, filtering=filtering)
        outs = jax.tree.map(lambda acc, x: acc.at[i].set(x), outs, out)
        return kv, ids.at[:R].set(out.token_ids), outs, loads

    k = num_logprobs
    outs0 = sampler_mod.SamplerOutput(
        jnp.zeros((num_steps, R), jnp.int32), jnp.zeros((num_steps, R), jnp.float32),
        jnp.zeros((num_steps, R), jnp.int32), jnp.zeros((num_steps, R, k), jnp.int32),
        jnp.zeros((num_steps, R, k), jnp.float32))
    loads0 = jnp.zeros((num_steps, *moe_layers), jnp.int32) if moe_layers else None
    kv_caches, _, outs, loads = jax.lax.fori_loop(0, num_steps, body, (kv_caches, ids, outs0, loads0))
    last = outs.token_ids[limit - 1, jnp.arange(R)]
    padded = jnp.zeros(max_rows, jnp.int32).at[:R].set(last)
    return (kv_caches, outs, padded, loads) if moe_layers else (kv_caches, outs, padded)


def forward_pack(input_ids, positions, md: AttentionMetadata, logits_idx, prev_index, step_limit=None):
    """The forward's host inputs as one int32 buffer and its (static) layout; ``step_limit`` [R] (each row's
    iterations) for the multi-step decode loop."""
    extra = {} if step_limit is None else {"step_limit": step_limit}
    ints, _, layout = packing.pack({
        "input_ids": input_ids, "positions": positions, "logits_idx": logits_idx, "prev_index": prev_index,
        **extra, **packing.prefixed("md.", packing.fields(md))})
    return ints, layout


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


class ModelRunner:
    def __init__(self, model, config: EngineConfig, max_model_len: int, mesh=None):
        self.model = model
        self.cfg = model.config
        self.config = config
        self.mesh = mesh
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.buckets = sorted({min(int(b), self.max_num_tokens) for b in config.scheduler.token_buckets}
                              | {self.max_num_tokens}) if config.scheduler.token_buckets \
            else token_buckets(self.max_num_tokens)
        self.backend = resolve_attention_backend(config.attention_backend)
        if jax.default_backend() == "gpu" and self.buckets[0] < MIN_TOKEN_BUCKET:
            logger.warning("token bucket %d is below %d: a bucket of 1 decoded ~10x slower than 8 on the H200 (XLA "
                           "lowers one-row matmuls as multiply + reduce fusions); 2 is not measured in the engine",
                           self.buckets[0], MIN_TOKEN_BUCKET)
        self.max_logprobs = config.max_logprobs
        self.vocab_size = self.cfg.vocab_size
        self.stats = RunnerStats()
        self.moe_layers = _moe_layers(model)       # (MoE layers, experts): the step returns its expert load
        if self.moe_layers:
            self.stats.expert_load = ExpertLoad(np.zeros(self.moe_layers, np.int64))
        self.kv_dtype = kernel_ops.kv_cache_dtype(config.cache.kv_cache_dtype,
                                                  jax.tree_util.tree_leaves(model.params)[0].dtype)
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._init_kv_caches()
        # Under a mesh every step output has a declared sharding (the cache's own, the rest replicated), and
        # the executables are compiled for the same shardings in: a step fed what an earlier step returned
        # runs the executable compiled ahead (one called with other shardings raises: never a recompile).
        rep, fwd_out, samp_out, loop_out = None, {}, {}, {}
        if mesh is not None:
            from jaxserve.parallel import kv_cache_sharding, replicated
            rep = replicated(mesh)
            kv_sh = kv_cache_sharding(mesh, self.cfg)
            load_out = (rep,) if self.moe_layers else ()
            fwd_out = {"out_shardings": (kv_sh, rep, *load_out)}
            samp_out = {"out_shardings": rep}
            loop_out = {"out_shardings": (kv_sh, rep, rep, *load_out)}
        self._replicated = rep
        # what each kind's jit is given besides its static arguments (a stored program's call gets the same)
        self._jit_kwargs = {"forward": {"donate_argnums": (1,), **fwd_out}, "sample": samp_out,
                            "decode-loop": {"donate_argnums": (1,), **loop_out}}
        # bind_mesh: the forward traces under the mesh so attention runs in shard_map over "tp"
        self._forward = jax.jit(bind_mesh(partial(_forward_fn, model.family, self.cfg, self.backend,
                                                  self.moe_layers is not None), mesh),
                                static_argnames=("layout", "decode_only", "max_seq_len"),
                                **self._jit_kwargs["forward"])
        # Steps whose requests all decode one token get their own variant of the small buckets under the
        # Pallas backends: the attention runs its decode launch alone (no prefill tile slots, the decode
        # tile's shared memory only). The reference has one path for both, so no extra compiles there.
        self.uniform_decode = self.backend != "reference"
        # Decode-only steps whose contexts are all within SHORT_SEQ_LEN get one more variant where it changes the
        # attention's launch: one decode launch instead of flash-decoding splits sized for max_model_len and
        # their combine (the splits a batch-1 step takes at short context cost a launch a layer). Compiled in
        # the background; until then (or past the bound) a step runs the ordinary decode-only variant.
        self._short_decode = self.uniform_decode and max_model_len > SHORT_SEQ_LEN
        # On GPU the sampler must not contain XLA conditionals (each one syncs the host with the device), so
        # the host says whether any row filters (top-k/top-p): two static variants. CPU keeps lax.cond.
        self.static_sampling = jax.default_backend() != "cpu"
        filter_modes = (False, True) if self.static_sampling else (None,)
        self._samplers = {(nl, f): jax.jit(partial(_sample_fn, nl, self.max_num_seqs, f), static_argnames=("layout",),
                                           **samp_out)
                          for nl in (0, self.max_logprobs) for f in filter_modes}
        # a structured-output step passes its bitmask to the same jitted samplers: a separate executable
        # (another input signature), so a step without constrained rows runs exactly the unmasked program
        tokenizer = getattr(model, "tokenizer", None)
        self.bitmask_width = (max(self.vocab_size, len(tokenizer) if tokenizer is not None else 0) + 31) // 32
        self._no_prev = self._zeros(self.max_num_seqs, jnp.int32)
        # multi-step decoding (--num-scheduler-steps): one decode loop per (token bucket, logprobs, filter mode)
        self.num_scheduler_steps = config.scheduler.num_scheduler_steps
        self._decode_loops = {}
        if self.num_scheduler_steps > 1:
            self._decode_loops = {
                (nl, f): jax.jit(bind_mesh(partial(_decode_loop_fn, model.family, self.cfg, self.backend,
                                                   self.max_num_seqs, self.block_size, self.num_scheduler_steps,
                                                   nl, f, self.moe_layers), mesh),
                                 static_argnames=("layout", "s_layout"), **self._jit_kwargs["decode-loop"])
                for nl in (0, self.max_logprobs) for f in filter_modes}
        # penalties ship output/prompt ids at one fixed width (max_model_len rounded up to a power of two)
        self.penalty_width = sampler_mod.length_bucket(max_model_len)
        self._step_count = 0
        # each request's block-table row and sampling parameters, kept across steps
        self.input_batch = InputBatch(self.max_num_seqs, self.max_blocks_per_seq, self.vocab_size)
        # what the executables are compiled for: shapes, dtypes and shardings only (a background compile must
        # not touch the cache buffers a step is donating meanwhile)
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))  # noqa: E731
        self._param_specs = jax.tree.map(spec, model.params)
        self._kv_specs = jax.tree.map(spec, self.kv_caches)
        self._prev_spec = spec(self._no_prev)
        self.enforce_eager = config.enforce_eager or config.skip_warmup
        self.variants = StepCompiler(self._lower_variant)
        # the variants' exported programs (a warm start lowers them without tracing the model)
        from jaxserve.parallel import collectives
        self.programs = ProgramCache(program_cache.directory_for(jax.config.jax_compilation_cache_dir),
                                     context=f"mesh {mesh!r}; custom all-reduce {collectives._enabled} "
                                             f"fused norm {collectives.fuses_norm()}")
        # (exact bucket, decode-only) -> the compiled (bucket, decode-only) a step of that size runs in now;
        # rebuilt whenever more executables are ready
        self._routes: dict[tuple[int, bool], tuple[int, bool]] = {}
        self._routes_at = -1

    def _zeros(self, shape, dtype) -> jax.Array:
        """Zeros placed as step outputs are: replicated on the mesh (made there, not copied there: a copy onto
        a mesh spanning processes would first check every process holds the same value)."""
        return jnp.zeros(shape, dtype) if self._replicated is None else jnp.zeros(shape, dtype, device=self._replicated)

    # ---------------------------------------------------------------- KV cache sizing
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes on each device (the cache is split over "tp" by kv heads)."""
        c = self.cfg
        heads = kv_heads_per_device(c, tp_size(self.mesh))
        return 2 * c.num_layers * self.block_size * heads * c.head_dim * jnp.dtype(self.kv_dtype).itemsize

    def _num_kv_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override:
            return int(cc.num_gpu_blocks_override)
        per_block = self.kv_bytes_per_block()
        if cc.kv_cache_memory_bytes:
            budget = cc.kv_cache_memory_bytes
        else:
            memory = device_memory.limit_and_use(jax.local_devices()[0])
            if memory:
                limit, in_use = memory
                # leave room for activations/logits of the largest step
                act = 64 * self.max_num_tokens * max(self.cfg.hidden_size, self.cfg.intermediate_size) \
                    + 8 * self.max_num_seqs * self.vocab_size
                budget = int(limit * cc.gpu_memory_utilization) - in_use - act
            else:
                budget = cc.cpu_kv_cache_memory_bytes
        n = int(budget // per_block)
        # never more blocks than can ever be used at once
        n = min(n, self.max_num_seqs * self.max_blocks_per_seq + 1)
        if jax.process_count() > 1:
            # every process sizes the cache from its own device's free memory; the sharded cache needs one
            # shape everywhere, so all take the smallest
            from jax.experimental import multihost_utils
            n = int(np.min(multihost_utils.process_allgather(np.int32(n))))
        if n < self.max_blocks_per_seq + 1:
            raise ValueError(
                f"KV cache too small: {n} blocks of {self.block_size} tokens fit in {budget / 2**20:.0f} MiB, "
                f"one request of max_model_len={self.max_model_len} needs {self.max_blocks_per_seq}; "
                "raise --gpu-memory-utilization / --kv-cache-memory or lower --max-model-len")
        return n

    def _init_kv_caches(self):
        sharding = None
        if self.mesh is not None:
            from jaxserve.parallel import kv_cache_sharding
            sharding = kv_cache_sharding(self.mesh, self.cfg)
        return kernel_ops.init_kv_caches(self.cfg.num_layers, self.num_blocks, self.block_size, self.cfg.num_kv_heads,
                                         self.cfg.head_dim, self.kv_dtype, sharding=sharding)

    # ---------------------------------------------------------------- inputs
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"step has {num_tokens} tokens, above max_num_batched_tokens={self.max_num_tokens}")

    def num_reqs_for(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    def prepare(self, scheduled, prev: PendingStep | None = None, *, pad_to_compiled: bool = True):
        """Host arrays for one step. ``scheduled``: ScheduledRequest list (decodes first). A PLACEHOLDER
        token (sampled by ``prev``, not yet on the host) is read on device from ``prev``'s output.
        ``pad_to_compiled``: while the step's own bucket is still compiling, pad up to a compiled one.

        Vectorised: one pass over the requests gathers Python lists (tokens, starts, counts), the block
        tables come from the persistent ``input_batch`` rows (only new block ids are copied), numpy does the
        per-token arithmetic (positions, slots, offsets)."""
        n = len(scheduled)
        counts_list = [s.num_new_tokens for s in scheduled]
        n_tok = sum(counts_list)
        T, decode_only = self.bucket_for(n_tok), self.uniform_decode and 0 < n == n_tok
        if pad_to_compiled:
            T, decode_only = self._compiled_shape(T, decode_only)
        R = self.num_reqs_for(T)
        if n > R:
            raise ValueError(f"{n} requests in a step of {T} tokens (max_num_seqs={self.max_num_seqs})")
        bs = self.block_size
        i32 = np.int32
        input_ids = np.zeros(T, i32)
        positions = np.zeros(T, i32)
        slots = np.full(T, PAD_SLOT, i32)
        tables = np.zeros((R, self.max_blocks_per_seq), i32)
        seq_lens = np.zeros(R, i32)
        qsl = np.zeros(R + 1, i32)
        logits_idx = np.zeros(R, i32)
        prev_index = np.full(T, -1, i32)
        if n:
            starts = np.fromiter([s.start_pos for s in scheduled], i32, n)
            counts = np.fromiter(counts_list, i32, n)
            ends = np.cumsum(counts, dtype=i32)
            if n_tok == n:              # decodes only: one token each, no per-token expansion
                toks = [s.request.all_token_ids[s.start_pos] for s in scheduled]
                pos = starts
                tok_row = np.arange(n, dtype=i32)
            else:
                toks = list(chain.from_iterable(s.request.all_token_ids[s.start_pos:s.start_pos + s.num_new_tokens]
                                                for s in scheduled))
                tok_row = np.repeat(np.arange(n, dtype=i32), counts)
                pos = (starts - (ends - counts))[tok_row] + np.arange(n_tok, dtype=i32)
            input_ids[:n_tok] = toks
            positions[:n_tok] = pos
            # block tables: the requests' persistent rows (brought up to date), gathered into the padded table
            batch = self.input_batch
            rows = batch.rows_for(scheduled)
            lens = batch.sync_block_tables(scheduled, rows)
            tables[:n] = batch.block_table[rows]
            blk = pos // bs
            if np.any(blk >= lens[tok_row]):
                bad = int(np.flatnonzero(blk >= lens[tok_row])[0])
                raise IndexError(f"request {scheduled[int(tok_row[bad])].request.request_id}: position "
                                 f"{int(pos[bad])} is past its block table")
            slots[:n_tok] = tables[tok_row, blk] * bs + pos % bs
            seq_lens[:n] = starts + counts
            qsl[1:n + 1] = ends
            qsl[n + 1:] = n_tok
            logits_idx[:n] = ends - 1
            # placeholders: the last token of a chunk sampled by the step in flight
            waiting = np.flatnonzero(input_ids[ends - 1] == PLACEHOLDER)
            if waiting.size:
                rows = prev.rows if prev is not None else {}
                try:
                    src = [rows[scheduled[i].request.request_id] for i in waiting.tolist()]
                except KeyError as e:
                    raise RuntimeError(f"request {e.args[0]}: its last token is still on the device but "
                                       "no step in flight sampled it") from None
                last = ends[waiting] - 1
                prev_index[last] = src
                input_ids[last] = 0
        md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                               num_seqs=np.int32(n), decode_only=decode_only)
        return T, R, input_ids, positions, md, logits_idx, prev_index

    def _compiled_shape(self, T: int, decode_only: bool) -> tuple[int, bool]:
        """The compiled forward a step of bucket ``T`` runs in: its own, else (during start-up) the next
        larger compiled bucket, the decode-only variant where there is one. Nothing compiled at or above
        ``T`` (``--enforce-eager``): its own, which dispatch then compiles."""
        if self._routes_at != len(self.variants):
            self._routes_at = len(self.variants)
            self._routes = {}
            for b in self.buckets:
                for dec in (False, True):
                    for c in (c for c in self.buckets if c >= b):
                        if dec and ("forward", c, True) in self.variants:
                            self._routes[b, dec] = (c, True)
                            break
                        if ("forward", c, False) in self.variants:
                            self._routes[b, dec] = (c, False)
                            break
        return self._routes.get((T, decode_only), (T, decode_only))

    def sampling_metadata(self, scheduled, R: int):
        """The step's sampling arrays: gathered from the persistent rows, unless some request needs the
        general path (a penalty's token histories, stop ids min_tokens still blocks)."""
        reqs = [s.request for s in scheduled]
        num_out = np.fromiter([len(r.output_token_ids) for r in reqs], np.int64, len(reqs))
        batch = self.input_batch
        rows = batch.rows_for(scheduled)
        if not batch.needs_general_path(rows, num_out):
            return batch.sampling_metadata(rows, num_out, R, step=self._step_count, engine_seed=self.config.seed)
        return sampler_mod.make_sampling_metadata(
            [r.sampling_params for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.prompt_token_ids for r in reqs],
            num_out.tolist(),
            self.vocab_size, pad_to=R,
            request_ids=[r.request_id for r in reqs],
            request_seeds=[r.sampling_seed for r in reqs],
            step=self._step_count, engine_seed=self.config.seed,
            penalty_width=self.penalty_width)

    # ---------------------------------------------------------------- step
    def dispatch(self, scheduled, prev: PendingStep | None = None) -> PendingStep:
        """Build the inputs and launch the step; returns at once (JAX dispatches asynchronously)."""
        step = self.dispatch_forward(scheduled, prev)
        return step if isinstance(step, PendingStep) else self.dispatch_sample(step)

    def dispatch_forward(self, scheduled, prev: PendingStep | None = None) -> "ForwardStep | PendingStep":
        """Launch the step's forward; the sampler follows with ``dispatch_sample`` (structured outputs fill
        their bitmask in between). A multi-step decode runs forward and sampler in one loop: it comes back
        as a PendingStep at once."""
        t0 = time.perf_counter()
        multi = bool(self._decode_loops) and any(s.num_steps > 1 for s in scheduled)
        # a multi-step decode runs in its own bucket's loop (compiled on first use if need be)
        T, R, input_ids, positions, md, logits_idx, prev_index = self.prepare(scheduled, prev,
                                                                              pad_to_compiled=not multi)
        smeta = self.sampling_metadata(scheduled, R)
        prev_tokens = prev.tokens if prev is not None else self._no_prev
        limit = None
        if multi:                                                           # multi-step: the decode loop
            limit = np.ones(R, np.int32)
            limit[:len(scheduled)] = [s.num_steps for s in scheduled]
        f_ints, f_layout = forward_pack(input_ids, positions, md, logits_idx, prev_index, limit)
        logits = load = None
        if limit is None:   # the forward first: the device starts on it while the host finishes the step
            # numpy in, so jit moves each buffer itself: 3 host-to-device copies, not ~24 (zero-copy on CPU)
            fwd = md.decode_only and self._short_decode and int(md.seq_lens.max(initial=0)) <= SHORT_SEQ_LEN \
                and self.variants.get(("forward", T, True, SHORT_SEQ_LEN))
            fwd = fwd or self.variants.get(("forward", T, md.decode_only)) or \
                self.variants.need(("forward", T, md.decode_only), f"a step of {T} tokens")
            self.kv_caches, logits, *load = fwd(self.model.params, self.kv_caches, f_ints, prev_tokens)
            load = self._copy_load(load)
        s_ints, s_floats, s_layout = packing.pack(packing.fields(smeta))
        # the sampling requests' output rows; from their persistent rows the logprobs wanted and (GPU)
        # whether any row filters with top-k/top-p
        rows = {s.request.request_id: i for i, s in enumerate(scheduled) if s.samples}
        batch, lp_k = self.input_batch, {}
        b_rows = batch.rows_for(scheduled)
        if len(rows) != len(scheduled):
            b_rows = b_rows[np.fromiter([s.samples for s in scheduled], bool, len(scheduled))]
        wanted = batch.num_logprobs[b_rows]
        if (wanted >= 0).any():
            lp_k = {rid: int(k) for rid, k in zip(rows, wanted.tolist()) if k >= 0}
        filtering = bool(batch.filters[b_rows].any()) if self.static_sampling else None
        key = (self.max_logprobs if lp_k else 0, filtering)
        if limit is None:
            return ForwardStep(logits, s_ints, s_floats, s_layout, key, rows, lp_k, int(md.query_start_loc[-1]), R,
                               (time.perf_counter() - t0) * 1e3, load)
        # the scheduler gave each entry ``num_steps``: the loop's rows run that many
        loop_key = ("decode-loop", T, *key, s_layout)
        loop = self.variants.get(loop_key) or self.variants.need(loop_key, f"a multi-step decode of {T} tokens")
        self.kv_caches, out, padded, *load = loop(self.model.params, self.kv_caches, f_ints, prev_tokens, s_ints,
                                                  s_floats)
        load = self._copy_load(load)
        self._step_count += self.num_scheduler_steps
        n_tok, steps = int(limit[:len(scheduled)].sum()), {s.request.request_id: s.num_steps for s in scheduled}
        self.stats.host_ms += (time.perf_counter() - t0) * 1e3
        return PendingStep(out, padded, rows, lp_k, n_tok, steps, load)

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
        key = ("sample", *step.key, bitmask is not None, step.s_layout)
        exe = self.variants.get(key) or self._sampler_on_first_use(key)
        if bitmask is None:
            out, padded = exe(step.logits, step.s_ints, step.s_floats)
        else:
            out, padded = exe(step.logits, step.s_ints, step.s_floats, bitmask)
        self._step_count += 1
        self.stats.host_ms += step.t_host + (time.perf_counter() - t0) * 1e3
        return PendingStep(out, padded, step.rows, step.logprobs_k, step.num_tokens, None, step.expert_load)

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
        self._account(pending, t0)
        rows, steps = pending.rows, pending.steps

        def entry(at, k):   # (logprob, rank, top ids, top logprobs) at a row, or (iteration, row)
            return float(lp[0][at]), int(lp[1][at]), lp[2][at][:k].tolist(), lp[3][at][:k].tolist()
        if steps is None:
            toks = token_ids.tolist()
            res = StepResult({rid: toks[i] for rid, i in rows.items()}, {})
            for rid, k in pending.logprobs_k.items():
                res.logprobs[rid] = entry(rows[rid], k)
        else:               # multi-step: [steps, R] arrays, row i ran steps[rid] of them
            toks = token_ids.T.tolist()
            res = StepResult({rid: toks[i][:steps[rid]] for rid, i in rows.items()}, {})
            for rid, k in pending.logprobs_k.items():
                res.logprobs[rid] = [entry((j, rows[rid]), k) for j in range(steps[rid])]
        return res

    def _account(self, pending: PendingStep, t0: float) -> None:
        st = self.stats
        st.device_ms += (time.perf_counter() - t0) * 1e3
        st.steps += 1
        st.tokens += pending.num_tokens
        st.token_buckets[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, pending.num_tokens)] += 1

    # ---------------------------------------------------------------- compiling, warm-up
    def _padding_inputs(self, T: int):
        R = self.num_reqs_for(T)
        md = AttentionMetadata(
            slot_mapping=np.full(T, PAD_SLOT, np.int32),
            block_tables=np.zeros((R, self.max_blocks_per_seq), np.int32),
            seq_lens=np.zeros(R, np.int32), query_start_loc=np.zeros(R + 1, np.int32),
            num_seqs=np.int32(0))
        return np.zeros(T, np.int32), np.zeros(T, np.int32), md, np.zeros(R, np.int32)

    def _forward_inputs(self, T: int, multi_step: bool = False):
        """A step of bucket ``T``'s packed forward inputs (padding only) and their layout."""
        ids, pos, md, lidx = self._padding_inputs(T)
        limit = np.ones(self.num_reqs_for(T), np.int32) if multi_step else None
        return forward_pack(ids, pos, md, lidx, np.full(T, -1, np.int32), limit)

    def _sampler_layout(self, R: int, penalized: bool = False) -> packing.Layout:
        """The packed sampling metadata's layout for ``R`` rows: what every step without penalties ships
        (``penalized``: some row uses a penalty: the history arrays at ``penalty_width``)."""
        plist = [SamplingParams(repetition_penalty=1.1)] if penalized else []
        smeta = sampler_mod.make_sampling_metadata(
            plist, [[]] * len(plist), [[0]] * len(plist), [0] * len(plist), self.vocab_size, pad_to=R,
            request_seeds=[0] * len(plist), penalty_width=self.penalty_width)
        return packing.pack(packing.fields(smeta))[2]

    @staticmethod
    def _buffers(layout: packing.Layout) -> tuple[np.ndarray, np.ndarray]:
        """Zero int32 and float32 buffers of ``layout``'s sizes (what ``packing.pack`` would return)."""
        n_f = sum(math.prod(p.shape) for p in layout if p.kind == "f32")
        n_i = sum(math.prod(p.shape) for p in layout) - n_f
        return np.zeros(n_i, np.int32), np.zeros(n_f, np.float32)

    def _lower_variant(self, key):
        """Trace and lower one executable (``StepCompiler`` compiles it): from shapes, not buffers; from its
        stored program when ``self.programs`` has it."""
        kind = key[0]
        if kind == "forward":
            _, T, decode_only, *bound = key       # ("forward", T, True, SHORT_SEQ_LEN): short-context decodes
            ints, layout = self._forward_inputs(T)
            fn, args = self._forward, (self._param_specs, self._kv_specs, ints, self._prev_spec)
            static = {"layout": layout, "decode_only": decode_only, "max_seq_len": bound[0] if bound else None}
        elif kind == "sample":
            _, num_logprobs, filtering, masked, s_layout = key
            R = s_layout[0].shape[0]
            logits = jax.ShapeDtypeStruct((R, self.vocab_size), jnp.float32, sharding=self._replicated)
            extra = (np.zeros((R, self.bitmask_width), np.int32),) if masked else ()
            fn, args = self._samplers[num_logprobs, filtering], (logits, *self._buffers(s_layout), *extra)
            static = {"layout": s_layout}
        elif kind == "decode-loop":
            _, T, num_logprobs, filtering, s_layout = key
            ints, layout = self._forward_inputs(T, multi_step=True)
            fn = self._decode_loops[num_logprobs, filtering]
            args = (self._param_specs, self._kv_specs, ints, self._prev_spec, *self._buffers(s_layout))
            static = {"layout": layout, "s_layout": s_layout}
        else:
            raise KeyError(key)
        return self.programs.lower(key, fn, args, static, **self._jit_kwargs[kind])

    def _sampler_on_first_use(self, key):
        """A sampler variant no step has needed yet (logprobs, penalties, a bitmask, ...): compiled now for
        this request count (the step waits), then for the other request counts in the background."""
        _, num_logprobs, filtering, masked, s_layout = key
        exe = self.variants.need(key, "the first step that needs it")
        if not self.enforce_eager:
            R = s_layout[0].shape[0]
            self.variants.submit([("sample", num_logprobs, filtering, masked, _with_rows(s_layout, R, r))
                                  for r in self._request_counts() if r != R], priority=2)
        return exe

    def _request_counts(self) -> list[int]:
        return sorted({self.num_reqs_for(T) for T in self.buckets})

    def planned_variants(self) -> tuple[list, list]:
        """The executables compiled ahead: (what the first steps need, the rest, in the order wanted).

        First: the smallest bucket (a batch of decodes) and the largest (a step of any size pads up to it),
        with the sampler every request without logprobs, penalties or a grammar uses. Then the other buckets
        from the smallest up (decodes are the steps that run most), then the filtering samplers (GPU:
        requests with top-k/top-p). Logprobs, penalties and bitmasks compile on first use."""
        base_f = False if self.static_sampling else None
        decode_cap = self.bucket_for(min(self.max_num_seqs, self.max_num_tokens))

        def bucket(T):
            ks = [("sample", 0, base_f, False, self._sampler_layout(self.num_reqs_for(T)))]
            if self.uniform_decode and T <= decode_cap:
                ks.append(("forward", T, True))
            ks.append(("forward", T, False))
            if self._decode_loops and T <= decode_cap:
                ks.append(("decode-loop", T, 0, base_f, self._sampler_layout(self.num_reqs_for(T))))
            return ks
        first = bucket(self.buckets[0]) + bucket(self.buckets[-1])
        rest = [k for T in self.buckets[1:-1] for k in bucket(T)]
        if self._short_decode:   # after the rest: a step runs correctly without them, only slower
            kvh = kv_heads_per_device(self.cfg, tp_size(self.mesh))
            rest += [("forward", T, True, SHORT_SEQ_LEN) for T in self.buckets if T <= decode_cap and
                     kernel_ops.decode_splits(self.num_reqs_for(T), kvh, SHORT_SEQ_LEN)
                     < kernel_ops.decode_splits(self.num_reqs_for(T), kvh, self.max_model_len)]
        if self.static_sampling:
            rest += [("sample", 0, True, False, self._sampler_layout(r)) for r in self._request_counts()]
            if self._decode_loops:
                rest += [("decode-loop", T, 0, True, self._sampler_layout(self.num_reqs_for(T)))
                         for T in self.buckets if T <= decode_cap]
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
        first, rest = self.planned_variants()
        if not background:
            first, rest = first + rest, []
        self.variants.compile_now(first)
        if progress:
            logger.info("compiled %d step variants in %.1f s; %d more compile in the background", len(first),
                        time.perf_counter() - t0, len(rest))
        self.variants.submit(rest, priority=1)
        return time.perf_counter() - t0

    def warmup_for(self, prompt_lens: list[int]) -> float:
        """A one-shot run that knows its prompts (``jaxserve generate``): compile, concurrently, what its
        steps will run — the first step's prefill bucket and the decode bucket of its requests, each with
        its sampler — and nothing else (no background compiles to outlive the run). A step that needs
        another bucket pads up to one of these or compiles it then. Returns the seconds it blocked."""
        t0 = time.perf_counter()
        if not prompt_lens:
            return 0.0
        base_f = False if self.static_sampling else None
        n = min(len(prompt_lens), self.max_num_seqs)
        prefill = self.bucket_for(min(sum(prompt_lens[:n]), self.max_num_tokens))
        decode = self.bucket_for(min(n, self.max_num_tokens))
        keys = [("sample", 0, base_f, False, self._sampler_layout(self.num_reqs_for(T))) for T in (prefill, decode)]
        keys += [("forward", prefill, False), ("forward", decode, self.uniform_decode)]
        if self._decode_loops:
            keys.append(("decode-loop", decode, 0, base_f, self._sampler_layout(self.num_reqs_for(decode))))
        self.variants.compile_now(keys)
        return time.perf_counter() - t0

    def stop_background_compiles(self, wait: bool = False) -> None:
        """Drop the queued background compiles (a one-shot run); a variant a step needs still compiles.
        ``wait``: also for the compiles in progress, after which no compile thread holds this runner."""
        self.variants.stop(wait=wait)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compiles are done (False on timeout)."""
        return self.variants.wait_all(timeout)

    def compile_stats(self) -> dict:
        """Compiled executables, those still queued, the ones a step waited for, and compile seconds."""
        v = self.variants
        return {"compiled": len(v), "pending": v.pending(), "on_first_use": len(v.on_first_use),
                "compile_seconds": round(sum(v.seconds.values()), 3)}

    def compiled_variants(self) -> int:
        """How many executables exist (the no-recompilation test compares this before and after a workload)."""
        return len(self.variants)


def _with_rows(layout: packing.Layout, old: int, new: int) -> packing.Layout:
    """A sampler layout for ``new`` rows instead of ``old`` (every per-row piece's leading axis)."""
    return tuple(p._replace(shape=(new, *p.shape[1:])) if p.name != "engine_key_data" and p.shape[:1] == (old,)
                 else p for p in layout)
