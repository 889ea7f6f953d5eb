"""The paged KV cache's layout and size: its dtype, how many blocks fit in the memory left for it, and the
arrays themselves (per layer, split over "tp" by kv heads under a mesh)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kernels import ops as kernel_ops
from jaxserve.parallel import kv_heads_per_device, tp_size
from jaxserve.runner import device_memory


def kv_dtype(config: EngineConfig, params):
    """The cache's dtype: ``--kv-cache-dtype``, or the weights' ("auto")."""
    return kernel_ops.kv_cache_dtype(config.cache.kv_cache_dtype, jax.tree_util.tree_leaves(params)[0].dtype)


def bytes_per_block(cfg, block_size: int, dtype, mesh=None) -> int:
    """Bytes one block takes on each device (the cache is split over "tp" by kv heads)."""
    heads = kv_heads_per_device(cfg, tp_size(mesh))
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def num_blocks(cfg, config: EngineConfig, max_model_len: int, dtype, mesh=None) -> int:
    """How many blocks the cache gets: the override, else the KV budget (``--kv-cache-memory``, or the
    device's memory share less what is in use and the largest step's activations) over a block's bytes, at
    most what max_num_seqs requests of max_model_len can use, the same on every process."""
    cc, sc = config.cache, config.scheduler
    if cc.num_gpu_blocks_override:
        return int(cc.num_gpu_blocks_override)
    block_size = cc.block_size
    max_blocks_per_seq = math.ceil(max_model_len / block_size)
    per_block = bytes_per_block(cfg, block_size, dtype, mesh)
    if cc.kv_cache_memory_bytes:
        budget = cc.kv_cache_memory_bytes
    else:
        memory = device_memory.limit_and_use(jax.local_devices()[0])
        if memory:
            limit, in_use = memory
            # leave room for activations/logits of the largest step
            act = 64 * sc.max_num_batched_tokens * max(cfg.hidden_size, cfg.intermediate_size) \
                + 8 * sc.max_num_seqs * cfg.vocab_size
            budget = int(limit * cc.gpu_memory_utilization) - in_use - act
        else:
            budget = cc.cpu_kv_cache_memory_bytes
    n = int(budget // per_block)
    # never more blocks than can ever be used at once
    n = min(n, sc.max_num_seqs * max_blocks_per_seq + 1)
    if jax.process_count() > 1:
        # every process sizes the cache from its own device's free memory; the sharded cache needs one
        # shape everywhere, so all take the smallest
        from jax.experimental import multihost_utils
        n = int(np.min(multihost_utils.process_allgather(np.int32(n))))
    if n < max_blocks_per_seq + 1:
        raise ValueError(
            f"KV cache too small: {n} blocks of {block_size} tokens fit in {budget / 2**20:.0f} MiB, "
            f"one request of max_model_len={max_model_len} needs {max_blocks_per_seq}; "
            "raise --gpu-memory-utilization / --kv-cache-memory or lower --max-model-len")
    return n


def allocate(cfg, num_blocks: int, block_size: int, dtype, mesh=None):
    """The per-layer caches, zeroed (under a mesh: placed with the cache's sharding)."""
    sharding = None
    if mesh is not None:
        from jaxserve.parallel import kv_cache_sharding
        sharding = kv_cache_sharding(mesh, cfg)
    return kernel_ops.init_kv_caches(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                                     sharding=sharding)
