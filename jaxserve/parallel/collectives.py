"""The row-parallel projections' all-reduce: XLA's, or the CUDA one-shot kernel for small steps.

``row_parallel_matmul(x, w)`` is ``x @ w`` for a row-parallel weight (o, down): ``x`` split on its last axis
over ``"tp"``, ``w`` on its first, the result summed over the devices. Without a tp mesh, or when the custom
all-reduce is not enabled in this process, it is plain ``x @ w`` and XLA inserts its all-reduce. With it
enabled (``enable_custom_all_reduce``, called by the engine on every process before the first trace), the
matmul and the sum run in ``shard_map``: each device multiplies its shards, then ``kernels.custom_allreduce``
sums the partial results when they fit its buffers (decode and small mixed steps), else ``lax.psum`` does.

Why: at TP=2 a Llama-3.1-8B decode token carries 64 of these all-reduces, and the custom kernel takes about
half of XLA's time for each (kernels/README.md). vLLM users know it as the custom all-reduce
(``--disable-custom-all-reduce``); the flag keeps its name here.

``row_parallel_matmul_add_rms_norm(x, w, residual, norm_weight, eps, rms_norm)`` is the same projection followed
by what a pre-norm layer does next, ``s = residual + x @ w`` and ``rms_norm(s, norm_weight, eps)``; with the
kernel enabled the three are one launch (``custom_allreduce.all_reduce_add_rms_norm``), else the plain ops.
``JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM=0`` keeps them apart (benchmark A/B).

It is enabled only where it can work: an NVIDIA GPU, tensor parallelism with one process per GPU
(``--distributed-executor-backend mp`` or ``--num-processes``), and ``nvcc`` to build the kernel. Every process
takes part in the decision (two rounds through ``jax.distributed``), so either all of them use it or none.
"""
from __future__ import annotations


import os
from typing import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxserve import envs
from jaxserve.kernels import custom_allreduce as car

from .mesh import TP, current_tp_mesh


_enabled = False
_fuse_norm = False
_generation = 0           # key-value store tags must not repeat within one coordinator's life


def row_parallel_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` with ``w`` row-parallel over ``"tp"`` (see the module docstring)."""
    mesh = current_tp_mesh()
    if mesh is None or not _enabled:
        return x @ w
    out_shape = x.shape[:-1] + w.shape[-1:]

    def local(xs, ws):
        part = xs @ ws
        return car.all_reduce(part) if car.supports(out_shape, part.dtype) else lax.psum(part, TP)

    x_spec = P(*([None] * (x.ndim - 1)), TP)
    # check_vma=False: the custom call's result is the same on every device, which the type system cannot see
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(TP, None)), out_specs=P(), check_vma=False)(x, w)


def row_parallel_matmul_add_rms_norm(x: jax.Array, w: jax.Array, residual: jax.Array, norm_weight: jax.Array,
                                     eps: float, rms_norm: Callable) -> tuple[jax.Array, jax.Array]:
    """``(s, rms_norm(s, norm_weight, eps))`` with ``s = residual + x @ w``, ``w`` row-parallel over ``"tp"``."""
    mesh = current_tp_mesh()
    out_shape = x.shape[:-1] + w.shape[-1:]
    if (mesh is None or not fuses_norm() or residual.dtype != x.dtype
            or not car.supports_add_rms_norm(out_shape, x.dtype)):
        s = residual + row_parallel_matmul(x, w)
        return s, rms_norm(s, norm_weight, eps)

    def local(xs, ws, res, nw):
        return car.all_reduce_add_rms_norm(xs @ ws, res, nw, eps)

    x_spec = P(*([None] * (x.ndim - 1)), TP)
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(TP, None), P(), P()), out_specs=(P(), P()),
                         check_vma=False)(x, w, residual, norm_weight)


def kernel_toolchain():
    """Where the CUDA kernels are built (``kernels.cuda_build``), from jaxserve's environment registry."""
    from jaxserve.kernels import cuda_build
    return cuda_build.Toolchain(
        cache_dir=envs.JAXSERVE_KERNEL_CACHE or os.path.join(envs.XDG_CACHE_HOME, "jaxserve", "kernels"),
        nvcc=envs.JAXSERVE_NVCC, cuda_home=envs.CUDA_HOME, arch=envs.JAXSERVE_CUDA_ARCH)


def fuses_norm() -> bool:
    """Whether ``row_parallel_matmul_add_rms_norm`` uses the fused kernel in this process."""
    return _enabled and _fuse_norm


def enable_custom_all_reduce(mesh, *, disable: bool = False) -> str | None:
    """Set up the custom all-reduce for this process's device of ``mesh``; ``None`` when it is on, else why not.

    Collective: under ``jax.distributed`` every process must call it with the same arguments.
    """
    global _enabled, _fuse_norm, _generation
    _enabled = False
    if mesh is None or mesh.shape[TP] < 2:
        return "no tensor parallelism"
    if disable:
        return "--disable-custom-all-reduce"
    if jax.default_backend() != "gpu":
        return f"needs NVIDIA GPUs (backend {jax.default_backend()!r})"
    world = mesh.shape[TP]
    if jax.process_count() != world or len(jax.local_devices()) != 1:
        return ("needs one process per GPU (--distributed-executor-backend mp); this process drives "
                f"{len(jax.local_devices())} of the mesh's {world} devices")
    rank = jax.process_index()
    device = jax.local_devices()[0]
    _generation += 1
    tag = f"jaxserve-car-{_generation}"
    reason = None
    try:
        handle = car.create(device, rank, world, kernel_toolchain())
    except Exception as e:  # noqa: BLE001  (any failure here must still reach the other ranks as a "no")
        handle, reason = None, f"{type(e).__name__}: {e}"
    # round 1: every rank's IPC handle, or that it has none; round 2: whether every rank mapped its peers
    statuses = car.distributed_exchange(rank, world, tag=f"{tag}/create")(b"ok" + handle if handle else b"no")
    if any(not s.startswith(b"ok") for s in statuses):
        return reason or "another process could not set it up (see its log)"
    try:
        car.open_peers(device, [s[2:] for s in statuses])
    except Exception as e:  # noqa: BLE001
        reason = f"{type(e).__name__}: {e}"
    opened = car.distributed_exchange(rank, world, tag=f"{tag}/open")(b"no" if reason else b"ok")
    if any(s != b"ok" for s in opened):
        return reason or "another process could not map its peers' buffers (see its log)"
    _enabled = True
    _fuse_norm = envs.JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM
    return None
