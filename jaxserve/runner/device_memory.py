"""How much memory the KV cache may plan on: the device's allocator limit and what is in use on it.

JAX's BFC allocator reports both (``memory_stats()``). The VMM allocator, which XLA selects for the command-buffer
update mode jaxserve runs with (``jaxserve/xla_flags.py``), reports nothing: there the limit is what that allocator
may map — JAX's memory fraction of the device's memory (``cuDeviceTotalMem``) — and the use is the bytes of the
arrays alive on the device (the weights, at the point the cache is sized).
"""
from __future__ import annotations

import ctypes
import logging

import jax

from jaxserve import envs

logger = logging.getLogger(__name__)


def limit_and_use(device) -> tuple[int, int] | None:
    """(bytes the allocator may hand out, bytes in use) on ``device``; None where neither is known (a CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:                       # noqa: BLE001 — an allocator without statistics
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    if device.platform != "gpu":
        return None
    total = cuda_total_memory(device.local_hardware_id)
    if total is None:
        return None
    limit = int(total * envs.XLA_PYTHON_CLIENT_MEM_FRACTION)
    return limit, int(stats.get("bytes_in_use") or live_bytes(device))


def live_bytes(device) -> int:
    """Bytes of the live arrays' shards placed on ``device``."""
    return sum(shard.data.nbytes for a in jax.live_arrays() for shard in a.addressable_shards
               if shard.device == device)


def cuda_total_memory(ordinal: int | None) -> int | None:
    """The CUDA device's memory in bytes (the driver's ``cuDeviceTotalMem``), None if the driver does not say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, total = ctypes.c_int(), ctypes.c_size_t()
        if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), int(ordinal or 0)) != 0
                or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev) != 0):
            return None
    except (OSError, AttributeError) as e:
        logger.warning("cannot read the GPU's memory size from the CUDA driver: %s", e)
        return None
    return int(total.value)
