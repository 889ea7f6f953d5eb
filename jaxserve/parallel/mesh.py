"""The device mesh of tensor parallelism: one axis, ``"tp"``, and the shardings of what lives on it.

Megatron layout (the model declares it per weight, see ``DecoderFamily.param_partition_specs``): column-parallel
q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding and lm_head. Activations between layers and
all step inputs are replicated; XLA inserts one all-reduce after attention and one after the MLP.

KV heads when ``tp > num_kv_heads``: the cache and the k/v projections are *replicated* (every device
holds and writes all kv heads) and each device's attention reads the one kv head its q heads use (see
``attention.py``). vLLM instead makes tp copies of the heads so each device stores one; replication is
simpler here and costs cache memory only in that rare case (8B-class models have 8 kv heads).
"""
from __future__ import annotations

import contextvars
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

TP = "tp"
# the pipeline stages (``pipeline.StageMeshes``) weights load onto while ``pipeline.placing`` is on, else None
STAGE_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar("stage_placement", default=None)


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ``("tp",)`` mesh over the first ``tensor_parallel_size`` devices.

    Multi-process (after ``jaxserve.executor.distributed.initialize``) ``jax.devices()`` lists every
    process's devices, so the mesh spans them. Auto axis types: XLA propagates shardings from the
    weights, so the model code stays plain jnp.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(f"tensor_parallel_size={tensor_parallel_size}", tensor_parallel_size, devices)
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,), axis_types=(AxisType.Auto,))


def check_device_count(what: str, need: int, devices: Sequence[jax.Device]) -> None:
    """Raise, saying how to get more, when ``devices`` are fewer than ``need``."""
    if len(devices) < need:
        kind = devices[0].platform if devices else "device"
        raise ValueError(
            f"{what} needs {need} devices, but only {len(devices)} {kind} device(s) are visible"
            + (" (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
               if kind == "cpu" else ""))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def check_tp_compatible(cfg, tp: int) -> None:
    """Raise a one-line, actionable error when the model cannot be split ``tp`` ways (heads, MLP, vocab)."""
    if tp == 1:
        return
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    problems = []
    if hq % tp:
        problems.append(f"{hq} attention heads are not divisible by tensor_parallel_size={tp}")
    if hkv % tp and tp % hkv:
        problems.append(f"{hkv} kv heads and tensor_parallel_size={tp}: one must divide the other")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size {cfg.intermediate_size} is not divisible by {tp}")
    if cfg.vocab_size % tp:   # vocab-parallel embedding and lm_head (no vocab padding here)
        problems.append(f"vocab_size {cfg.vocab_size} is not divisible by {tp}")
    problems += _expert_problems(cfg, tp)
    if problems:
        sizes = [n for n in range(1, hq + 1) if hq % n == 0 and (hkv % n == 0 or n % hkv == 0)
                 and cfg.intermediate_size % n == 0 and cfg.vocab_size % n == 0 and not _expert_problems(cfg, n)]
        raise ValueError(f"cannot shard this model with tensor_parallel_size={tp}: " + "; ".join(problems)
                         + f" (sizes that work: {sizes})")


def _expert_problems(cfg, tp: int) -> list[str]:
    """A mixture-of-experts model's split (models/layers/moe.py): whole experts per device under expert
    parallelism, else each expert's (and the shared expert's) intermediate columns."""
    extra = dict(getattr(cfg, "extra", ()) or ())
    if "num_experts" not in extra:
        return []
    if extra.get("enable_expert_parallel"):
        experts = int(extra["num_experts"])
        return [] if experts % tp == 0 else [f"{experts} experts are not divisible by {tp} (expert parallel)"]
    sizes = {"moe_intermediate_size": extra.get("moe_intermediate_size"),
             "shared_expert_intermediate_size": extra.get("shared_expert_intermediate_size")}
    return [f"{name} {size} is not divisible by {tp}" for name, size in sizes.items() if size and int(size) % tp]


def kv_heads_sharded(cfg, tp: int) -> bool:
    """True when each device owns ``num_kv_heads / tp`` kv heads; False when kv heads are replicated."""
    return tp > 1 and cfg.num_kv_heads % tp == 0


def kv_heads_per_device(cfg, tp: int) -> int:
    """KV heads each device stores: what sizes the cache against one device's memory."""
    return cfg.num_kv_heads // tp if kv_heads_sharded(cfg, tp) else cfg.num_kv_heads


def kv_cache_spec(cfg, tp: int) -> P:
    """PartitionSpec of one layer's K or V cache ``[num_blocks, kv_heads, block_size, head_dim]``."""
    return P(None, TP, None, None) if kv_heads_sharded(cfg, tp) else P()


def kv_cache_sharding(mesh: Mesh, cfg) -> NamedSharding:
    """Sharding of each layer's K and V cache: kv heads over ``"tp"`` (replicated when tp > kv heads)."""
    check_tp_compatible(cfg, tp_size(mesh))
    return NamedSharding(mesh, kv_cache_spec(cfg, tp_size(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def current_tp_mesh():
    """The context (abstract) mesh when it has a ``"tp"`` axis of size > 1, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or TP not in mesh.axis_names or mesh.shape[TP] == 1:
        return None
    return mesh


def gather_logits(logits: jax.Array) -> jax.Array:
    """Inside the step: vocab-sharded logits ``[R, vocab]`` → replicated (no-op without a tp mesh in context).

    The vocab-parallel lm_head gives each device ``[R, vocab/tp]``; the sampler runs on the gathered
    ``[R, vocab]``: one all-gather of R rows per step, simpler than a sharded top-k/top-p, and small next to
    the weights a step reads. Pinning the vocab-sharded layout first matters: asked only for a replicated
    result, XLA all-gathers the lm_head weight instead.
    """
    if current_tp_mesh() is None:
        return logits
    logits = jax.lax.with_sharding_constraint(logits, P(*([None] * (logits.ndim - 1)), TP))
    return jax.lax.with_sharding_constraint(logits, P())


def adjust_spec_for_tp(name: str, spec: P, cfg, tp: int) -> P:
    """Replicate the k/v projections when kv heads are replicated (tp > num_kv_heads).

    Splitting ``kv_heads * head_dim`` columns tp ways would cut a head in half; attention then needs
    whole heads, so they stay whole and every device computes all of them (small: k/v are 1/4 of q or
    less in GQA models).
    """
    if tp > 1 and not kv_heads_sharded(cfg, tp) and _is_kv_projection(name):
        return P()
    return spec


def _is_kv_projection(name: str) -> bool:
    """``layers.3.k`` / ``layers.3.v_bias`` (``DecoderFamily.param_shapes`` names) and HF-style ``k_proj``/``v_proj``."""
    leaf = name.replace("/", ".").split(".")[-1]
    return leaf in ("k", "v", "k_bias", "v_bias", "k_proj", "v_proj")


def param_shardings(specs: Any, mesh: Mesh, cfg=None) -> Any:
    """``NamedSharding`` per weight from a pytree of ``PartitionSpec`` (``DecoderFamily.param_partition_specs``).

    With ``cfg`` given, checks the heads split evenly and replicates k/v projections when tp > kv heads.
    """
    tp, stages = tp_size(mesh), STAGE_PLACEMENT.get()   # inside ``pipeline.placing``: on its stage's mesh
    if stages is not None:
        stages = stages.for_layers(cfg.num_layers)
    if cfg is not None:
        check_tp_compatible(cfg, tp)

    def one(path, spec):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if cfg is not None:
            spec = adjust_spec_for_tp(name, spec, cfg, tp)
        return NamedSharding(mesh if stages is None else stages.mesh_of(name), spec)

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=lambda x: isinstance(x, P))
