"""What the kernels' launch heuristics read of the GPU they run on."""
from __future__ import annotations

import functools

import jax

SHARED_MEMORY = 227 << 10  # an H100 / H200 block's shared memory limit (bytes, the opt-in maximum)

# where the device reports no count (CPU interpret mode, where only correctness is checked): a Hopper's
ASSUMED_SMS = 132


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the first local device (a GPU's ``core_count``)."""
    count = getattr(jax.local_devices()[0], "core_count", None)
    return int(count) if count else ASSUMED_SMS
