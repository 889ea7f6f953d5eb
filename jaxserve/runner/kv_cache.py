"""The paged KV cache's layout and size: its dtype, how many blocks fit in the memory left for it, the
longest sequence they hold, and the arrays themselves. The model's family says each layer's cache arrays
(``DecoderFamily.kv_cache_shapes``: K and V pages, or one latent page with MLA); under a mesh K/V are split over
"tp" by kv heads, a latent cache is replicated."""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.errors import ModelLoadError
from jaxserve.kernels import ops as kernel_ops
from jaxserve.models import registry
from jaxserve.parallel import tp_size
from jaxserve.parallel.mesh import kv_heads_sharded
from jaxserve.runner import device_memory

logger = logging.getLogger(__name__)


def kv_dtype(config: EngineConfig, params):
    """The cache's dtype: ``--kv-cache-dtype``, or the weights' ("auto")."""
    return kernel_ops.kv_cache_dtype(config.cache.kv_cache_dtype, jax.tree_util.tree_leaves(params)[0].dtype)


def layer_shapes(cfg, num_blocks: int, block_size: int, dtype) -> tuple[tuple[int, ...], ...]:
    """The shapes of one layer's cache arrays, as the model's family lays them out."""
    _, family = registry.resolve_architecture(cfg.architecture)
    return family.kv_cache_shapes(cfg, num_blocks, block_size, dtype)


def bytes_per_block(cfg, block_size: int, dtype, mesh=None, num_layers: int | None = None) -> int:
    """Bytes one block takes on each device (split over "tp" where the kv heads are; ``num_layers``: the
    layers a device holds, the largest pipeline stage's)."""
    per_layer = sum(math.prod(shape[1:]) for shape in layer_shapes(cfg, 1, block_size, dtype))
    split = tp_size(mesh) if kv_heads_sharded(cfg, tp_size(mesh)) else 1
    return (num_layers or cfg.num_layers) * per_layer * jnp.dtype(dtype).itemsize // split


def fit(cfg, config: EngineConfig, max_model_len: int, dtype, mesh=None,
        num_layers: int | None = None) -> tuple[int, int]:
    """(the cache's blocks, the longest sequence served). ``max_model_len`` is the model's (the loader's);
    where one request of it does not fit the blocks, a model default (no ``--max-model-len``) becomes the
    longest that does, said in one log line, and an explicit ``--max-model-len`` is a ModelLoadError naming
    both numbers and the flags that change them."""
    block_size = config.cache.block_size
    n, budget = budget_blocks(cfg, config, dtype, mesh, num_layers)
    n = offset_safe_blocks(cfg, block_size, dtype, mesh, n)
    fits = (n - 1) * block_size          # block 0 is the null block
    if fits < max_model_len:
        where = f"{n} blocks of {block_size} tokens" + (f" in {budget / 2**20:.0f} MiB" if budget else "")
        if config.max_model_len is not None or fits < block_size:
            raise ModelLoadError(
                f"--max-model-len {max_model_len} does not fit the KV cache: {where} hold {max(fits, 0)} tokens for "
                f"one request; lower --max-model-len to {max(fits, 0)} or less, or give the cache more memory "
                "(--kv-cache-memory, --gpu-memory-utilization)")
        logger.warning("max_model_len %d: the model's %d tokens do not fit the KV cache (%s); --max-model-len or "
                       "--kv-cache-memory / --gpu-memory-utilization change it", fits, max_model_len, where)
        max_model_len = fits
    # never more blocks than can ever be used at once
    return min(n, config.scheduler.max_num_seqs * math.ceil(max_model_len / block_size) + 1), max_model_len


# Pallas's Triton lowering addresses an array of at most 4 GiB with 32-bit element offsets (64-bit above): a
# 1-byte array (an fp8 cache) between 2 and 4 GiB holds more elements than those offsets reach
OFFSET_LIMIT, WIDE_OFFSETS_ABOVE = 2**31, 2**32


def offset_safe_blocks(cfg, block_size: int, dtype, mesh, n: int) -> int:
    """``n`` blocks, or fewer where a layer's 1-byte cache array (on one device) would fall between 2 and 4 GiB:
    then capped at 2 GiB (said in one log line), so the kernels' 32-bit offsets reach every element."""
    if jnp.dtype(dtype).itemsize != 1:
        return n
    split = tp_size(mesh) if kv_heads_sharded(cfg, tp_size(mesh)) else 1
    per_block = max(math.prod(shape[1:]) for shape in layer_shapes(cfg, 1, block_size, dtype)) // split
    if not OFFSET_LIMIT < n * per_block <= WIDE_OFFSETS_ABOVE:
        return n
    cap = OFFSET_LIMIT // per_block
    logger.warning("the %s KV cache holds %d blocks, not %d: a layer's cache array is kept at 2 GiB, since the "
                   "Pallas kernels address a 1-byte array of 2 to 4 GiB with 32-bit offsets that do not reach past "
                   "2 GiB", jnp.dtype(dtype).name, cap, n)
    return cap


def budget_blocks(cfg, config: EngineConfig, dtype, mesh=None, num_layers: int | None = None) -> tuple[int, int | None]:
    """(how many blocks the KV budget holds, the budget in bytes): the override, else the budget
    (``--kv-cache-memory``, or the device's memory share less what is in use and the largest step's
    activations) over a block's bytes; the same on every process (the smallest)."""
    cc, sc = config.cache, config.scheduler
    if cc.num_gpu_blocks_override:
        return int(cc.num_gpu_blocks_override), None
    per_block = bytes_per_block(cfg, cc.block_size, dtype, mesh, num_layers)
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
            warn_over_xla_planning_base(jax.local_devices()[0], in_use, budget)
        else:
            budget = cc.cpu_kv_cache_memory_bytes
    n = max(int(budget // per_block), 0)
    if jax.process_count() > 1:
        # every process sizes the cache from its own device's free memory; the sharded cache needs one
        # shape everywhere, so all take the smallest
        from jax.experimental import multihost_utils
        n = int(np.min(multihost_utils.process_allgather(np.int32(min(n, np.iinfo(np.int32).max)))))
    return n, int(budget)



# XLA's GPU scheduler and rematerialization plan a program's memory against this share of the device's memory
XLA_PLANNING_SHARE = 0.8


def warn_over_xla_planning_base(device, in_use: int, budget: int) -> bool:
    """Log a warning (and return True) when the weights and arrays in use plus the KV budget exceed the share of
    the GPU's memory XLA plans each program against: its rematerialization pass then cannot get under its limit
    and compiles slowly or not at all (an 8B fp8 model under ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` did not
    compile its prefill program in 140 s)."""
    if device.platform != "gpu":
        return False
    total = device_memory.cuda_total_memory(device.local_hardware_id)
    if not total or in_use + budget <= XLA_PLANNING_SHARE * total:
        return False
    logger.warning("the weights (%.1f GiB in use) and the KV cache budget (%.1f GiB) exceed %d%% of the GPU's "
                   "%.1f GiB, the memory XLA plans each program against: compiles may be slow or fail; lower "
                   "XLA_PYTHON_CLIENT_MEM_FRACTION or --gpu-memory-utilization", in_use / 2**30, budget / 2**30,
                   round(100 * XLA_PLANNING_SHARE), total / 2**30)
    return True

def allocate(cfg, num_blocks: int, block_size: int, dtype, mesh=None, stages=None):
    """The per-layer caches, zeroed (under a mesh: placed with the cache's sharding; with pipeline
    ``stages``, each layer's on its stage's mesh)."""
    from jaxserve.parallel import kv_cache_sharding
    meshes = [mesh] * cfg.num_layers if stages is None else \
        [m for m, (a, b) in zip(stages.meshes, stages.for_layers(cfg.num_layers).bounds) for _ in range(a, b)]
    shapes = layer_shapes(cfg, num_blocks, block_size, dtype)

    def zeros(shape, mesh):
        return jnp.zeros(shape, dtype) if mesh is None else jnp.zeros(shape, dtype, device=kv_cache_sharding(mesh, cfg))
    return [tuple(zeros(shape, m) for shape in shapes) for m in meshes]
