"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): each prompt token's logprob given the tokens
before it, its rank and the top-k alternatives.

One extra prefill of the prompt on a scratch paged cache (allocated inside the call, never an input), then
logits at every position in chunks of ``CHUNK`` rows so a long prompt never materializes ``[S, vocab]``.
A rarely used feature, so it stays off the hot path: the step's executables are untouched, and this one is
compiled per power-of-two prompt length on first use.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels import ops as kernel_ops
from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
from jaxserve.parallel import bind_mesh, gather_logits
from jaxserve.runner.sampler import compute_logprobs

CHUNK = 256


def _score_fn(family, cfg, backend, block_size, k, dtype, params, ids, targets, md):
    S = ids.shape[0]
    num_blocks = 1 + md.block_tables.shape[1]
    caches = kernel_ops.init_kv_caches(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    hidden, _ = family.forward(params, caches, ids, jnp.arange(S, dtype=jnp.int32), md, cfg, attn_backend=backend)

    def chunk(args):
        h, t = args
        logits = gather_logits(family.compute_logits(params, h, cfg)).astype(jnp.float32)
        return compute_logprobs(jax.nn.log_softmax(logits, axis=1), t, k)

    c = min(CHUNK, S)
    return jax.lax.map(chunk, (hidden.reshape(S // c, c, -1), targets.reshape(S // c, c)))


class PromptScorer:
    def __init__(self, model, *, attn_backend: str, block_size: int, max_logprobs: int, mesh=None):
        self.model = model
        self.cfg = model.config
        self.block_size = block_size
        self.k = max_logprobs
        self.dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
        self._fn = jax.jit(bind_mesh(partial(_score_fn, model.family, self.cfg, attn_backend, block_size,
                                             max_logprobs, self.dtype), mesh))

    def bucket(self, n: int) -> int:
        return max(self.block_size, 1 << (n - 1).bit_length())

    def score(self, prompt_ids: list[int]) -> list[tuple[float, int, list[int], list[float]] | None]:
        """Per prompt position: None for the first token, else (logprob, rank, top ids, top logprobs) of
        ``prompt_ids[i]`` given ``prompt_ids[:i]`` (top lists of ``max_logprobs`` entries)."""
        n = len(prompt_ids)
        S = self.bucket(n)
        if S > CHUNK:
            S = math.ceil(S / CHUNK) * CHUNK
        bs = self.block_size
        ids = np.zeros(S, np.int32)
        ids[:n] = prompt_ids
        targets = np.zeros(S, np.int32)
        targets[:n - 1] = prompt_ids[1:]
        slots = np.full(S, PAD_SLOT, np.int32)
        slots[:n] = bs + np.arange(n)                       # blocks 1.. of the scratch cache, in order
        pages = S // bs
        md = AttentionMetadata(slot_mapping=slots, block_tables=np.arange(1, pages + 1, dtype=np.int32)[None],
                               seq_lens=np.array([n], np.int32), query_start_loc=np.array([0, n], np.int32),
                               num_seqs=np.int32(1))
        lp, rank, top_ids, top_lp = (np.asarray(x).reshape(S, -1) if x.ndim == 3 else np.asarray(x).reshape(S)
                                     for x in self._fn(self.model.params, ids, targets, md))
        out: list = [None]
        for i in range(n - 1):
            out.append((float(lp[i]), int(rank[i]), top_ids[i].tolist(), top_lp[i].tolist()))
        return out
