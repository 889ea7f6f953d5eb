"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): each prompt token's logprob given the tokens
before it, its rank and the top-k alternatives.

Scored chunk by chunk as the scheduler prefills the prompt, so a scoring request is like any other: its
chunks share the step's token budget with everyone's decodes, it is counted in running/waiting, and an abort
stops it between chunks. After a step that prefills positions ``[a, b)`` of such a request is dispatched,
``PromptLogprobsScorer.dispatch`` launches one more forward over the not yet scored positions of that chunk
against the request's own blocks (which the step has just written; this forward writes nothing: its slots
are the null block), then logits at every position in chunks of ``CHUNK`` rows so a long chunk never
materializes ``[S, vocab]``. The results stay on the device until the step itself is read (``collect``).

The step's executables are untouched (a rarely used feature stays off the hot path). The scorer has one
executable per power-of-two count of positions scored at once, up to half of ``max_num_batched_tokens`` (the
scheduler counts each position to score twice against the budget, so no step scores more). The engine makes
the scorer when the first scoring request arrives and its executables compile on the step compiler's
background threads; scoring requests wait in the queue until they are ready (``ready``), so no request
stalls the engine thread on a compile. With ``--enforce-eager`` they compile on first use, as steps do.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
from jaxserve.outputs import decode_logprobs
from jaxserve.parallel import bind_mesh, gather_logits
from jaxserve.runner.sampler import compute_logprobs
from jaxserve.runner.step_compiler import StepCompiler

CHUNK = 256
MIN_BUCKET = 16


def _score_fn(family, cfg, backend, k, params, kv_caches, ids, positions, targets, md):
    S = ids.shape[0]
    # a LoRA engine's weights (folded ones hold the adapters' A columns): the base model, slot 0 throughout
    lora = {} if "lora" not in params else {"lora": (params["lora"], jnp.zeros(S, jnp.int32))}
    params = {k: v for k, v in params.items() if k != "lora"}
    hidden, kv_caches = family.forward(params, kv_caches, ids, positions, md, cfg, attn_backend=backend, **lora)

    def chunk(args):
        h, t = args
        logits = gather_logits(family.compute_logits(params, h, cfg)).astype(jnp.float32)
        return compute_logprobs(jax.nn.log_softmax(logits, axis=1), t, k)

    c = min(CHUNK, S)
    return kv_caches, jax.lax.map(chunk, (hidden.reshape(S // c, c, -1), targets.reshape(S // c, c)))


@dataclasses.dataclass(slots=True)
class ScoredChunk:
    """Prompt positions ``first .. first + count - 1`` of ``request``, scored on the device."""
    request: object
    first: int
    count: int
    arrays: tuple                   # (logprob, rank, top ids, top logprobs), device arrays of S rows


def wants_scoring(req) -> bool:
    """Whether the request asked for prompt logprobs and has prompt positions not yet sent for scoring."""
    return req.sampling_params.prompt_logprobs is not None and \
        req.num_prompt_positions_scored < req.num_prompt_tokens - 1


class PromptLogprobsScorer:
    def __init__(self, model, kv_caches, *, attn_backend: str, max_blocks_per_seq: int,
                 max_num_batched_tokens: int, max_logprobs: int, mesh=None, background: bool = True,
                 params=None):
        """``params``: the current step weights when called (a LoRA engine's: ``ModelRunner.step_params``);
        by default the model's."""
        self.model = model
        self.params = params or (lambda: model.params)
        self.cfg = model.config
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_bucket = self.bucket(max(1, max_num_batched_tokens // 2))
        self.k = max_logprobs
        out = {}
        if mesh is not None:
            from jaxserve.parallel import kv_cache_sharding, replicated
            out = {"out_shardings": (kv_cache_sharding(mesh, self.cfg), replicated(mesh))}
        self._fn = jax.jit(bind_mesh(partial(_score_fn, model.family, self.cfg, attn_backend, max_logprobs), mesh),
                           donate_argnums=(1,), **out)
        # compiled for shapes, dtypes and shardings only: a background compile must not touch the cache
        # buffers the steps are donating meanwhile
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))  # noqa: E731
        self._param_specs = jax.tree.map(spec, self.params())
        self._kv_specs = jax.tree.map(spec, kv_caches)
        self.compiler = StepCompiler(self._lower)
        if background:
            self.compiler.submit(self.buckets())

    @staticmethod
    def bucket(n: int) -> int:
        return max(MIN_BUCKET, 1 << (n - 1).bit_length())

    def buckets(self) -> list[int]:
        out, S = [], MIN_BUCKET
        while S <= self.max_bucket:
            out.append(S)
            S *= 2
        return out

    def ready(self) -> bool:
        """Whether no executable is still queued or compiling (a scoring request may be scheduled)."""
        return self.compiler.pending() == 0

    def pending(self) -> int:
        return self.compiler.pending()

    def _lower(self, S: int):
        return self._fn.lower(self._param_specs, self._kv_specs, *self._inputs([0] * (S + 1), 0, S, []))

    def dispatch(self, scheduled, kv_caches) -> tuple[object, list[ScoredChunk]]:
        """Launch the scoring forward for each scheduled prompt chunk that has positions to score (call it
        after the step that computes those chunks is dispatched). Returns the KV caches (donated through,
        unchanged) and the chunks in flight."""
        chunks = []
        for s in scheduled:
            req = s.request
            if not wants_scoring(req):
                continue
            # position p scores prompt token p + 1, so the last prompt position scores nothing
            first = max(s.start_pos, req.num_prompt_positions_scored)
            end = min(s.start_pos + s.num_new_tokens, req.num_prompt_tokens - 1)
            if end <= first:
                continue
            kv_caches, arrays = self._launch(req.prompt_token_ids, first, end, s.block_ids, kv_caches)
            req.num_prompt_positions_scored = end
            chunks.append(ScoredChunk(req, first, end - first, arrays))
        return kv_caches, chunks

    def _launch(self, prompt: list[int], first: int, end: int, block_ids: list[int], kv_caches):
        inputs = self._inputs(prompt, first, end, block_ids)
        S = inputs[0].shape[0]
        assert S <= self.max_bucket, (S, self.max_bucket)      # the scheduler budgets scored positions twice
        exe = self.compiler.get(S) or self.compiler.need(S, f"prompt scoring of {end - first} positions")
        return exe(self.params(), kv_caches, *inputs)

    def _inputs(self, prompt: list[int], first: int, end: int, block_ids: list[int]):
        """(ids, positions, targets, metadata) of prompt positions first .. end - 1, padded to their bucket."""
        n = end - first
        S = self.bucket(n)
        ids = np.zeros(S, np.int32)
        ids[:n] = prompt[first:end]
        targets = np.zeros(S, np.int32)
        targets[:n] = prompt[first + 1:end + 1]
        positions = np.zeros(S, np.int32)
        positions[:n] = np.arange(first, end, dtype=np.int32)
        tables = np.zeros((1, self.max_blocks_per_seq), np.int32)
        tables[0, :len(block_ids)] = block_ids
        md = AttentionMetadata(slot_mapping=np.full(S, PAD_SLOT, np.int32), block_tables=tables,
                               seq_lens=np.array([end], np.int32), query_start_loc=np.array([0, n], np.int32),
                               num_seqs=np.int32(1))
        return ids, positions, targets, md

    def collect(self, chunks: list[ScoredChunk], tokenizer, max_logprobs: int) -> None:
        """Bring scored chunks to the host (after their step is read) and append vLLM's per-position
        ``{token: Logprob}`` to each request's ``prompt_logprobs`` (the first prompt position is None)."""
        for c in chunks:
            req = c.request
            if req.prompt_logprobs is None:         # already sent (a preempted request recomputing)
                continue
            assert len(req.prompt_logprobs) == c.first + 1, (req.request_id, len(req.prompt_logprobs), c.first)
            lp, rank, top_ids, top_lp = (np.asarray(x).reshape(-1, *x.shape[2:]) for x in c.arrays)
            k = req.sampling_params.prompt_logprobs
            k = max_logprobs if k == -1 else k
            prompt = req.prompt_token_ids
            for i in range(c.count):
                req.prompt_logprobs.append(decode_logprobs(tokenizer, prompt[c.first + 1 + i], lp[i], rank[i],
                                                           top_ids[i], top_lp[i], num_logprobs=k))
