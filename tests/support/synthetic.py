"""Random ragged paged-attention batches for the kernel tests and benchmarks (no engine needed)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.kernels.ops import kv_cache_shapes
from jaxserve.kernels.ref_attention import quantize_kv, v_transposed


def make_batch(rng: np.random.Generator, q_lens, ctx_lens, *, block_size: int, num_q_heads: int,
               num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16, cache_dtype=None,
               pad_tokens: int = 0, pad_reqs: int = 0, share_prefix: bool = True, spare_blocks: int = 3,
               max_blocks_per_seq: int | None = None):
    """A step of ``len(q_lens)`` requests: ``q [T, Hq, D]``, K/V caches, metadata.

    Request r has ``q_lens[r]`` new tokens and ``ctx_lens[r]`` tokens of context (new ones included).
    Physical blocks are a shuffled permutation (block 0 = null block is never used); when
    ``share_prefix``, every request whose first block is full shares request 0's first block if that
    one is full too (prefix caching). ``pad_tokens``/``pad_reqs`` add padding like the runner's buckets.
    The cache is random everywhere (unused blocks included), so a wrong page read changes the result.
    """
    q_lens, ctx_lens = list(map(int, q_lens)), list(map(int, ctx_lens))
    assert all(1 <= q <= c for q, c in zip(q_lens, ctx_lens))
    n = len(q_lens)
    need = [-(-c // block_size) for c in ctx_lens]
    width = max_blocks_per_seq or max(need)
    num_blocks = 1 + sum(need) + spare_blocks
    perm = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables = np.zeros((n + pad_reqs, width), np.int32)
    for r in range(n):
        tables[r, :need[r]] = [perm.pop() for _ in range(need[r])]
    if share_prefix and ctx_lens[0] - q_lens[0] >= block_size:
        for r in range(1, n):
            if ctx_lens[r] - q_lens[r] >= block_size:
                tables[r, 0] = tables[0, 0]
    T = sum(q_lens) + pad_tokens
    qsl = np.zeros(n + pad_reqs + 1, np.int32)
    qsl[1:n + 1] = np.cumsum(q_lens)
    qsl[n + 1:] = qsl[n]
    seq_lens = np.zeros(n + pad_reqs, np.int32)
    seq_lens[:n] = ctx_lens
    slots = np.zeros(T, np.int32)                  # padding tokens -> PAD_SLOT
    t = 0
    for r in range(n):
        for p in range(ctx_lens[r] - q_lens[r], ctx_lens[r]):
            slots[t] = tables[r, p // block_size] * block_size + p % block_size
            t += 1
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                           seq_lens=jnp.asarray(seq_lens), query_start_loc=jnp.asarray(qsl),
                           num_seqs=jnp.asarray(n, jnp.int32))
    cache_dtype = cache_dtype or dtype
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)).astype(cache_dtype)
            for shape in kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype))
    q = jnp.asarray(rng.standard_normal((T, num_q_heads, head_dim), np.float32)).astype(dtype)
    return q, k, v, md


def slot_major(cache, is_v: bool = False) -> np.ndarray:
    """One layer's K (or, ``is_v``, V) cache as float32 ``[slot, kv_heads, D]`` (slot = block * block_size +
    offset; an fp8 V cache's transposed pages turned back): caches in any layout compare slot for slot."""
    x = np.asarray(cache.astype(jnp.float32))
    if is_v and v_transposed(cache.dtype):
        x = np.swapaxes(x, 2, 3)
    nb, kvh, bs, d = x.shape
    return np.swapaxes(x, 1, 2).reshape(nb * bs, kvh, d)


def quantize_caches(k_cache, v_cache, cache_dtype, k_scale=None, v_scale=None):
    """Whole head-major caches ``[num_blocks, kv_heads, block_size, D]`` cast (fp8: scaled and saturated) to
    ``cache_dtype``, V transposed where that dtype wants it (``v_transposed``): caches as the engine keeps them."""
    if v_transposed(cache_dtype):
        v_cache = jnp.swapaxes(v_cache, 2, 3)
    return quantize_kv(k_cache, cache_dtype, k_scale), quantize_kv(v_cache, cache_dtype, v_scale)
