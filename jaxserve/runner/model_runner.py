"""The device side of a step: padded arrays from a scheduler decision, the jitted step, warm-up.

A step is two jitted calls dispatched back to back with no host sync between them: the model forward over
the flat ragged token list (prefill chunks and decode tokens together) returning logits for each request's
last token, then the on-device sampler. Splitting them keeps the expensive model executable to one per
token bucket (the sampler's variants — logprobs on/off, penalties on/off — are small graphs). The request
count follows the token bucket, every variant is compiled at start-up, and the KV cache is donated so XLA
updates it in place.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kernels import ops as kernel_ops
from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
from jaxserve.parallel import bind_mesh, gather_logits
from jaxserve.runner import sampler as sampler_mod

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16


def token_buckets(max_num_batched_tokens: int, smallest: int = MIN_TOKEN_BUCKET) -> list[int]:
    """Powers of two from ``smallest`` up to the token budget (the budget itself is the last bucket)."""
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
    """What one step sampled, on the host: per scheduled request that samples."""
    token_ids: dict[str, int]
    logprobs: dict[str, tuple[float, int, list[int], list[float]]]  # logprob, rank, top ids, top logprobs


@dataclasses.dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    host_ms: float = 0.0        # building inputs + dispatch, summed
    device_ms: float = 0.0      # waiting for the step's results, summed
    tokens: int = 0

    def snapshot(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "host_ms_per_step": self.host_ms / n,
                "device_ms_per_step": self.device_ms / n, "tokens_per_step": self.tokens / n}


def _forward_fn(family, cfg, backend, params, kv_caches, input_ids, positions, md, logits_indices):
    hidden, kv_caches = family.forward(params, kv_caches, input_ids, positions, md, cfg, attn_backend=backend)
    # under a tp mesh: vocab-sharded logits gathered once ([R, vocab]) for the sampler
    logits = gather_logits(family.compute_logits(params, hidden[logits_indices], cfg))
    return kv_caches, logits


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
        self.buckets = token_buckets(self.max_num_tokens)
        self.backend = resolve_attention_backend(config.attention_backend)
        self.max_logprobs = config.max_logprobs
        self.vocab_size = self.cfg.vocab_size
        self.stats = RunnerStats()
        self.num_compiles = 0
        self.kv_dtype = self._kv_cache_dtype()
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._init_kv_caches()
        # bind_mesh: the forward traces under the mesh so attention runs in shard_map over "tp"
        self._forward = jax.jit(bind_mesh(partial(_forward_fn, model.family, self.cfg, self.backend), mesh),
                                donate_argnums=(1,))
        self._samplers = {nl: jax.jit(partial(sampler_mod.sample, num_logprobs=nl))
                          for nl in (0, self.max_logprobs)}
        # penalties ship output/prompt ids at one fixed width (max_model_len rounded up to a power of two)
        self.penalty_width = sampler_mod.length_bucket(max_model_len)
        self._step_count = 0

    # ---------------------------------------------------------------- KV cache sizing
    def _kv_cache_dtype(self):
        dt = self.config.cache.kv_cache_dtype
        if dt in ("auto", None):
            return jax.tree_util.tree_leaves(self.model.params)[0].dtype
        if dt in ("fp8", "fp8_e4m3"):
            return jnp.float8_e4m3fn
        return jnp.dtype(dt)

    def kv_bytes_per_block(self) -> int:
        c = self.cfg
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * jnp.dtype(self.kv_dtype).itemsize

    def _num_kv_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override:
            return int(cc.num_gpu_blocks_override)
        per_block = self.kv_bytes_per_block()
        if cc.kv_cache_memory_bytes:
            budget = cc.kv_cache_memory_bytes
        else:
            stats = jax.local_devices()[0].memory_stats() or {}
            limit = stats.get("bytes_limit")
            if limit:
                in_use = stats.get("bytes_in_use", 0)
                # leave room for activations/logits of the largest step
                act = 64 * self.max_num_tokens * max(self.cfg.hidden_size, self.cfg.intermediate_size) \
                    + 8 * self.max_num_seqs * self.vocab_size
                budget = int(limit * cc.gpu_memory_utilization) - in_use - act
            else:
                budget = cc.cpu_kv_cache_memory_bytes
        n = int(budget // per_block)
        # never more blocks than can ever be used at once
        n = min(n, self.max_num_seqs * self.max_blocks_per_seq + 1)
        if n < self.max_blocks_per_seq + 1:
            raise ValueError(
                f"KV cache too small: {n} blocks of {self.block_size} tokens fit in {budget / 2**20:.0f} MiB, "
                f"one request of max_model_len={self.max_model_len} needs {self.max_blocks_per_seq}; "
                "raise --gpu-memory-utilization / --kv-cache-memory or lower --max-model-len")
        return n

    def _init_kv_caches(self):
        shape = kernel_ops.kv_cache_shape(self.num_blocks, self.block_size, self.cfg.num_kv_heads,
                                          self.cfg.head_dim)
        sharding = None
        if self.mesh is not None:
            from jaxserve.parallel import kv_cache_sharding
            sharding = kv_cache_sharding(self.mesh, self.cfg)

        def zeros():
            return jnp.zeros(shape, self.kv_dtype, device=sharding) if sharding is not None \
                else jnp.zeros(shape, self.kv_dtype)
        return [(zeros(), zeros()) for _ in range(self.cfg.num_layers)]

    # ---------------------------------------------------------------- inputs
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"step has {num_tokens} tokens, above max_num_batched_tokens={self.max_num_tokens}")

    def num_reqs_for(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    def prepare(self, scheduled):
        """Host arrays for one step. ``scheduled``: ScheduledRequest list (decodes first)."""
        n_tok = sum(s.num_new_tokens for s in scheduled)
        T = self.bucket_for(n_tok)
        R = self.num_reqs_for(T)
        if len(scheduled) > R:
            raise ValueError(f"{len(scheduled)} requests in a step of {T} tokens (max_num_seqs={self.max_num_seqs})")
        bs = self.block_size
        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, PAD_SLOT, np.int32)
        tables = np.zeros((R, self.max_blocks_per_seq), np.int32)
        seq_lens = np.zeros(R, np.int32)
        qsl = np.zeros(R + 1, np.int32)
        logits_idx = np.zeros(R, np.int32)
        off = 0
        for i, s in enumerate(scheduled):
            req, n, start = s.request, s.num_new_tokens, s.start_pos
            toks = req.all_token_ids[start:start + n]
            input_ids[off:off + n] = toks
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[off:off + n] = pos
            blocks = np.asarray(s.block_ids, np.int32)
            slots[off:off + n] = blocks[pos // bs] * bs + pos % bs
            tables[i, :len(blocks)] = blocks
            seq_lens[i] = start + n
            off += n
            qsl[i + 1] = off
            logits_idx[i] = off - 1
        qsl[len(scheduled) + 1:] = off
        md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                               num_seqs=np.int32(len(scheduled)))
        return T, R, input_ids, positions, md, logits_idx

    def sampling_metadata(self, scheduled, R: int):
        reqs = [s.request for s in scheduled]
        return sampler_mod.make_sampling_metadata(
            [r.sampling_params for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [len(r.output_token_ids) for r in reqs],
            self.vocab_size, pad_to=R,
            request_ids=[r.request_id for r in reqs],
            request_seeds=[r.sampling_seed for r in reqs],
            step=self._step_count, engine_seed=self.config.seed,
            penalty_width=self.penalty_width)

    # ---------------------------------------------------------------- step
    def execute(self, scheduled) -> StepResult:
        t0 = time.perf_counter()
        T, R, input_ids, positions, md, logits_idx = self.prepare(scheduled)
        smeta = self.sampling_metadata(scheduled, R)
        want_lp = any(s.samples and s.request.sampling_params.logprobs is not None for s in scheduled)
        self.kv_caches, logits = self._forward(self.model.params, self.kv_caches, input_ids, positions, md,
                                               logits_idx)
        out = self._samplers[self.max_logprobs if want_lp else 0](logits, smeta)
        self._step_count += 1
        t1 = time.perf_counter()
        token_ids = np.asarray(out.token_ids)
        t2 = time.perf_counter()
        res = StepResult({}, {})
        lp = None
        if want_lp:
            lp = (np.asarray(out.logprobs), np.asarray(out.ranks), np.asarray(out.topk_ids),
                  np.asarray(out.topk_logprobs))
        for i, s in enumerate(scheduled):
            if not s.samples:
                continue
            rid = s.request.request_id
            res.token_ids[rid] = int(token_ids[i])
            if lp is not None and s.request.sampling_params.logprobs is not None:
                k = s.request.sampling_params.logprobs
                res.logprobs[rid] = (float(lp[0][i]), int(lp[1][i]), lp[2][i, :k].tolist(), lp[3][i, :k].tolist())
        st = self.stats
        st.steps += 1
        st.host_ms += (t1 - t0) * 1e3
        st.device_ms += (t2 - t1) * 1e3
        st.tokens += sum(s.num_new_tokens for s in scheduled)
        return res

    # ---------------------------------------------------------------- warm-up
    def _padding_inputs(self, T: int):
        R = self.num_reqs_for(T)
        md = AttentionMetadata(
            slot_mapping=np.full(T, PAD_SLOT, np.int32),
            block_tables=np.zeros((R, self.max_blocks_per_seq), np.int32),
            seq_lens=np.zeros(R, np.int32), query_start_loc=np.zeros(R + 1, np.int32),
            num_seqs=np.int32(0))
        return np.zeros(T, np.int32), np.zeros(T, np.int32), md, np.zeros(R, np.int32)

    def warmup(self, progress: bool = True) -> float:
        """Compile every variant: the forward per token bucket; the sampler per request count, with and
        without logprobs and penalties. Runs them on padding-only inputs (writes go to the null block)."""
        from jaxserve.sampling_params import SamplingParams
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        penalized = SamplingParams(repetition_penalty=1.1)
        todo = [("forward", T) for T in self.buckets]
        todo += [(("sample", nl, pen), R) for R in sorted({self.num_reqs_for(T) for T in self.buckets})
                 for nl in self._samplers for pen in (False, True)]
        for what, size in tqdm(todo, desc="compiling step buckets", disable=not progress, unit="variant"):
            if what == "forward":
                ids, pos, md, lidx = self._padding_inputs(size)
                self.kv_caches, logits = self._forward(self.model.params, self.kv_caches, ids, pos, md, lidx)
                jax.block_until_ready(logits)
                continue
            _, nl, pen = what
            plist = [penalized] if pen else []
            smeta = sampler_mod.make_sampling_metadata(
                plist, [[]] * len(plist), [[0]] * len(plist), [0] * len(plist), self.vocab_size, pad_to=size,
                request_seeds=[0] * len(plist), penalty_width=self.penalty_width)
            out = self._samplers[nl](jnp.zeros((size, self.vocab_size), jnp.float32), smeta)
            jax.block_until_ready(out.token_ids)
        return time.perf_counter() - t0

    def compiled_variants(self) -> int:
        """How many executables exist (the no-recompilation test compares this before and after a workload)."""
        return self._forward._cache_size() + sum(f._cache_size() for f in self._samplers.values())
