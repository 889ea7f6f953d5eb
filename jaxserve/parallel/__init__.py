"""Tensor parallelism over a one-axis ``("tp",)`` mesh, multi-process start-up and the step channel."""
from .mesh import (TP, check_tp_compatible, current_tp_mesh, gather_logits, kv_cache_sharding, kv_cache_spec,
                   kv_heads_per_device, make_mesh, param_shardings, replicated, shard_step_inputs, tp_size)
from .attention import bind_mesh, paged_attention, write_kv, write_kv_and_attend
from .collectives import enable_custom_all_reduce, row_parallel_matmul, row_parallel_matmul_add_rms_norm
from .distributed import (BroadcastingRunner, StepChannel, fetch_replicated, follow_runner, follow_steps, initialize,
                          is_driver)

__all__ = [
    "TP", "make_mesh", "tp_size", "check_tp_compatible", "kv_cache_sharding", "kv_cache_spec", "kv_heads_per_device",
    "param_shardings", "replicated", "shard_step_inputs", "current_tp_mesh", "gather_logits", "bind_mesh", "paged_attention",
    "write_kv", "write_kv_and_attend", "BroadcastingRunner", "StepChannel", "fetch_replicated", "follow_steps", "follow_runner",
    "initialize", "is_driver", "row_parallel_matmul", "row_parallel_matmul_add_rms_norm", "enable_custom_all_reduce",
]
