"""Paged attention under tensor parallelism: ``kernels.ops`` wrapped in ``jax.shard_map`` over ``"tp"``.

The kernels are per-device math over the heads they are given. Under a mesh each device holds
``num_heads / tp`` q heads (column-parallel q projection) and its share of the KV cache, so attention needs
no communication: q, the new k/v and the cache are split on their head axis, the metadata is replicated,
and the output stays split on heads for the row-parallel o projection (whose all-reduce XLA inserts).

The model calls ``write_kv_and_attend`` (and ``write_kv`` / ``paged_attention``) from here with
``kernels.ops``'s signatures. They read
the mesh from JAX's abstract-mesh context (``jax.sharding.use_abstract_mesh``, or ``jax.set_mesh``
outside jit; see ``bind_mesh``): without one, or with tp == 1, they are exactly ``kernels.ops``. A
context mesh keeps the model's signature (``forward(..., attn_backend=)``) unchanged and the mesh out of
the hashable ``ModelConfig``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.kernels import ops
from jaxserve.kernels.ref_attention import head_scale
from jaxserve.kernels.metadata import AttentionMetadata

from .mesh import TP, current_tp_mesh

# check_vma=False on the shard_maps: the kernels are per-device math with no collectives, written without
# varying-manual-axes annotations (their loop carries start as constants), as Pallas kernels are.

HEADS = P(None, TP, None)               # [T, heads, head_dim]
CACHE_HEADS = P(None, TP, None, None)   # [num_blocks, kv_heads, block_size, head_dim]


def bind_mesh(fn, mesh):
    """``fn`` run with ``mesh`` as the context mesh: wrap the step function *before* ``jax.jit`` so its trace
    sees the mesh (the attention below shards over it). ``mesh=None`` returns ``fn`` unchanged."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def with_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return with_mesh


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, backend: str = "reference", **kernel_kwargs):
    """``kernels.ops.write_kv``; under a tp mesh each device scatters its own kv heads into its cache shard
    (or, with kv heads replicated because tp > kv heads, every device writes all of them)."""
    mesh = current_tp_mesh()
    if mesh is None:
        return ops.write_kv(k_cache, v_cache, k, v, slot_mapping, backend=backend, **kernel_kwargs)
    cache_spec, new_spec = _kv_specs(k.shape[1], mesh.shape[TP])
    kernel_kwargs, scales = _head_scales(kernel_kwargs, k.shape[1])
    return _sharded(functools.partial(ops.write_kv, backend=backend, **kernel_kwargs), mesh, cache_spec, scales,
                    (k_cache, v_cache, k, v, slot_mapping), (cache_spec, cache_spec, new_spec, new_spec, P()),
                    (cache_spec, cache_spec))


def paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    backend: str = "reference", **kernel_kwargs):
    """``kernels.ops.paged_attention``; under a tp mesh q heads (and kv heads) are split over ``"tp"``.

    ``kernel_kwargs`` (fp8 ``k_scale``/``v_scale``, ``interpret``) pass through to the kernel; per-head scales
    are split over the mesh with the kv heads they belong to.
    """
    mesh = current_tp_mesh()
    if mesh is None:
        return ops.paged_attention(q, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap,
                                   sliding_window=sliding_window, backend=backend, **kernel_kwargs)
    tp, num_q_heads, num_kv_heads = mesh.shape[TP], q.shape[1], k_cache.shape[1]
    if num_q_heads % tp:
        raise ValueError(f"{num_q_heads} attention heads are not divisible by tensor_parallel_size={tp}")
    cache_spec, _ = _kv_specs(num_kv_heads, tp)
    kernel_kwargs, scales = _head_scales(kernel_kwargs, num_kv_heads)
    kernel = functools.partial(ops.paged_attention, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, backend=backend, **kernel_kwargs)
    if cache_spec == CACHE_HEADS:
        local = kernel
    else:
        # Replicated kv heads: this device's q heads all use kv head (device * num_kv_heads // tp).
        def local(q, k_cache, v_cache, md, **head_scales):
            head = jax.lax.axis_index(TP) // (tp // num_kv_heads)
            one = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=head, slice_size=1)
            return kernel(q, one(k_cache, axis=1), one(v_cache, axis=1), md,
                          **{name: one(val, axis=0) for name, val in head_scales.items()})
    return _sharded(local, mesh, cache_spec, scales, (q, k_cache, v_cache, md),
                    (HEADS, cache_spec, cache_spec, P()), HEADS)


def write_kv_and_attend(q, k, v, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                        soft_cap: float | None = None, sliding_window: int | None = None,
                        backend: str = "reference", **kernel_kwargs):
    """``kernels.ops.write_kv_and_attend`` (a layer's K/V write then attention); under a tp mesh each device
    writes and attends with its own heads. With kv heads replicated (tp > kv heads) it is ``write_kv`` (every
    device writes every head) then ``paged_attention`` (each device's q heads read their kv head)."""
    mesh = current_tp_mesh()
    if mesh is None:
        return ops.write_kv_and_attend(q, k, v, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap,
                                       sliding_window=sliding_window, backend=backend, **kernel_kwargs)
    cache_spec, new_spec = _kv_specs(k.shape[1], mesh.shape[TP])
    if cache_spec != CACHE_HEADS:
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, md.slot_mapping, backend=backend, **kernel_kwargs)
        out = paged_attention(q, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap,
                              sliding_window=sliding_window, backend=backend, **kernel_kwargs)
        return out, k_cache, v_cache
    if q.shape[1] % mesh.shape[TP]:
        raise ValueError(f"{q.shape[1]} attention heads are not divisible by tensor_parallel_size={mesh.shape[TP]}")
    kernel_kwargs, scales = _head_scales(kernel_kwargs, k.shape[1])
    kernel = functools.partial(ops.write_kv_and_attend, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, backend=backend, **kernel_kwargs)
    return _sharded(kernel, mesh, cache_spec, scales, (q, k, v, k_cache, v_cache, md),
                    (HEADS, HEADS, HEADS, cache_spec, cache_spec, P()), (HEADS, cache_spec, cache_spec))


def _sharded(kernel, mesh, cache_spec: P, scales: dict, args: tuple, in_specs: tuple, out_specs):
    """``kernel(*args, **scales)`` under ``shard_map``: the per-head scales go in as trailing operands, split
    like the kv heads (whole where they are replicated), and reach the kernel by name."""
    n, names = len(args), tuple(scales)

    def call(*operands):
        return kernel(*operands[:n], **dict(zip(names, operands[n:])))

    scale_spec = P(TP) if cache_spec == CACHE_HEADS else P()
    fn = jax.shard_map(call, mesh=mesh, in_specs=tuple(in_specs) + (scale_spec,) * len(scales),
                       out_specs=out_specs, check_vma=False)
    return fn(*args, *scales.values())


def _head_scales(kernel_kwargs: dict, num_kv_heads: int) -> tuple[dict, dict]:
    """Splits per-head fp8 scales (``k_scale``/``v_scale`` with more than one element) out of the kernel
    keyword arguments: they enter the shard_map as ``[kv_heads]`` operands, split like the kv heads. Scalars
    stay keyword arguments (every device uses the same one)."""
    rest, scales = dict(kernel_kwargs), {}
    for name in ("k_scale", "v_scale"):
        val = rest.get(name)
        if val is not None and jnp.size(val) > 1:
            scales[name] = head_scale(rest.pop(name), num_kv_heads)
    return rest, scales


def _kv_specs(num_kv_heads: int, tp: int) -> tuple[P, P]:
    """(cache spec, new k/v spec): split on kv heads when they divide evenly, else replicated."""
    if num_kv_heads % tp == 0:
        return CACHE_HEADS, HEADS
    if tp % num_kv_heads:
        raise ValueError(f"{num_kv_heads} kv heads and tensor_parallel_size={tp}: one must divide the other")
    return P(), P()


def write_latent_and_attend(q_nope_latent, q_rope, latent, latent_cache, md: AttentionMetadata, *,
                            sm_scale: float, kv_lora_rank: int, backend: str = "reference", **kernel_kwargs):
    """``kernels.ops.write_latent_and_attend`` (an MLA layer's latent write then attention). Under a tp mesh
    the latent cache is replicated and the heads are split (vLLM's choice): every device writes the same
    rows into its full copy and attends with its own ``H / tp`` heads. The latent is one row per token for
    all heads, so it cannot be split by heads; splitting it by feature would need an all-reduce of the scores
    inside every attention. Replication costs each device the whole cache (``kv_lora_rank + rope_dim``
    values per token and layer), the price of no communication in attention."""
    kernel = functools.partial(ops.write_latent_and_attend, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank,
                               backend=backend, **kernel_kwargs)
    mesh = current_tp_mesh()
    if mesh is None:
        return kernel(q_nope_latent, q_rope, latent, latent_cache, md)
    if q_nope_latent.shape[1] % mesh.shape[TP]:
        raise ValueError(f"{q_nope_latent.shape[1]} attention heads are not divisible by "
                         f"tensor_parallel_size={mesh.shape[TP]}")
    return jax.shard_map(kernel, mesh=mesh, in_specs=(HEADS, HEADS, P(), P(), P()), out_specs=(HEADS, P()),
                         check_vma=False)(q_nope_latent, q_rope, latent, latent_cache, md)
