"""Backend dispatch for paged attention: the model calls these, never a backend directly."""
from __future__ import annotations

from . import ref_attention
from .metadata import AttentionMetadata

BACKENDS = ("reference", "pallas")


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) cache."""
    return (num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, backend: str = "reference"):
    return ref_attention.write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    backend: str = "reference"):
    if backend == "reference":
        return ref_attention.ragged_paged_attention(q, k_cache, v_cache, md, sm_scale=sm_scale,
                                                    soft_cap=soft_cap, sliding_window=sliding_window)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
