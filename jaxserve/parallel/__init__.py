"""Tensor parallelism over a one-axis ``("tp",)`` mesh: the mesh, PartitionSpecs, shard_map wrappers and
collectives (the processes that run it: ``jaxserve.executor``)."""
from .mesh import (TP, check_tp_compatible, current_tp_mesh, gather_logits, kv_cache_sharding, kv_cache_spec,
                   kv_heads_per_device, make_mesh, param_shardings, replicated, tp_size)
from .attention import bind_mesh, paged_attention, write_kv, write_kv_and_attend
from .collectives import enable_custom_all_reduce, row_parallel_matmul, row_parallel_matmul_add_rms_norm

__all__ = [
    "TP", "make_mesh", "tp_size", "check_tp_compatible", "kv_cache_sharding", "kv_cache_spec", "kv_heads_per_device",
    "param_shardings", "replicated", "current_tp_mesh", "gather_logits", "bind_mesh", "paged_attention",
    "write_kv", "write_kv_and_attend", "row_parallel_matmul", "row_parallel_matmul_add_rms_norm", "enable_custom_all_reduce",
]
