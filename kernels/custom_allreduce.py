"""A one-shot all-reduce for small tensor-parallel activations: CUDA (``custom_allreduce.cu``) as an XLA FFI call.

Why: a TP=2 decode step of Llama-3.1-8B carries 64 all-reduces of a few tens of KiB (one after attention and
one after the MLP, per layer). XLA's own collectives (one-shot NCCL kernels on the compute stream) cost a
fifth to a quarter of such a token (kernels/README.md has the figures). A kernel that writes each rank's shard straight into its peers' memory over NVLink, raises a flag and sums
what arrived, is latency-bound by one NVLink round trip instead. vLLM ships the same idea as its "custom
all-reduce" (``--disable-custom-all-reduce`` turns it off); this one is written for jaxserve's process-per-GPU
executor and for XLA:

- **Buffers**: each rank allocates one buffer (``cudaMalloc``) and shares it with ``cudaIpcGetMemHandle``; the
  handles travel through ``jax.distributed``'s key-value store and every rank maps its peers'. So it needs one
  process per GPU (``--distributed-executor-backend mp``), with every GPU visible to CUDA in each process
  (jaxserve's launcher selects devices with ``local_device_ids``, not ``CUDA_VISIBLE_DEVICES``).
- **In the step**: ``all_reduce(x)`` inside ``shard_map`` is a custom call on XLA's stream, allowed in
  command buffers (CUDA graphs): its per-call epoch lives on the device, so a graph replay advances it.
- **Numbers**: the ranks' values are summed in rank order in float32 and rounded once, so every rank holds the
  same bits; with two ranks that is also what XLA's psum gives.
- **Fused with the next norm**: ``all_reduce_add_rms_norm(x, residual, weight, eps)`` returns
  ``(residual + all_reduce(x), rms_norm(that))`` from one launch, the all-reduce and the sum each rounded as
  the unfused ops round them (the norm's statistics are summed in another order than XLA's). In a pre-norm
  layer the all-reduce is always followed by the residual add and the next RMSNorm; at T=4 those were two
  more kernels per all-reduce (128 per 8B token).
- **Limits**: inputs up to ``slot_bytes`` (1 MiB by default: 128 tokens of a 4096-wide bf16 hidden state), a
  multiple of 16 bytes; larger steps (prefill) keep XLA's all-reduce, which is bandwidth-bound there.
- **A peer that is gone**: a rank waits at most 120 s for its peers' flags, then the kernel traps, so the step
  fails with a CUDA error instead of hanging (NCCL would hang until jax.distributed's heartbeat gave up).
- **Lockstep**: every rank must make the same calls in the same order, as SPMD steps do; a rank one call ahead
  would be read as this call's data (the flags only say ">= this epoch").

The CUDA source is compiled on first use with the machine's ``nvcc`` (``cuda_build``) for the local GPU.
Without ``nvcc`` or a GPU, ``CustomAllReduceUnavailable`` says why and callers keep XLA's all-reduce. No CPU
path: tests drive the Python side on CPU; the kernel runs on two GPUs (its probe against psum,
``custom_allreduce_probe.py``, is in git history).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from . import cuda_build

SOURCE = Path(__file__).with_name("custom_allreduce.cu")
TARGET = "jaxserve_custom_all_reduce"
TARGET_ADD_RMS_NORM = "jaxserve_custom_all_reduce_add_rms_norm"
MAX_RANKS = 8
MAX_BLOCKS = 64
THREADS = 512                      # per CTA, as in the .cu
DEFAULT_SLOT_BYTES = 1 << 20

_lib = None


class CustomAllReduceUnavailable(RuntimeError):
    """The custom all-reduce cannot run here (no nvcc, no GPU, CUDA IPC refused, ...); the message says why."""


def build(toolchain: cuda_build.Toolchain, *, arch: str | None = None) -> Path:
    """Compile ``custom_allreduce.cu`` (once per source/compiler/headers) and return the shared library's path."""
    return cuda_build.build(SOURCE, toolchain, arch=arch, error=CustomAllReduceUnavailable)


def load(toolchain: cuda_build.Toolchain, arch: str | None = None):
    """The built library, with its FFI target registered with XLA for CUDA (once per process)."""
    global _lib
    if _lib is None:
        import jax
        import jax.ffi
        if jax.default_backend() != "gpu":
            raise CustomAllReduceUnavailable(f"needs an NVIDIA GPU (backend is {jax.default_backend()!r})")
        lib = ctypes.CDLL(str(build(toolchain, arch=arch)))
        lib.jaxserve_car_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                                            ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64]
        lib.jaxserve_car_open.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64]
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveCustomAllReduce), platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_ADD_RMS_NORM, jax.ffi.pycapsule(lib.JaxserveCustomAllReduceAddRmsNorm),
                                    platform="CUDA")
        _lib = lib
    return _lib


def create(device, rank: int, world: int, toolchain: cuda_build.Toolchain, *,
           slot_bytes: int = DEFAULT_SLOT_BYTES) -> bytes:
    """Allocate rank ``rank``'s buffer on ``device`` (a ``jax.Device``) and return its 64-byte CUDA IPC handle,
    for every other rank's ``open_peers``. An earlier set-up's buffers on the device are retired, not freed:
    executables compiled while they were current still hold their addresses."""
    if not 2 <= world <= MAX_RANKS:
        raise CustomAllReduceUnavailable(f"{world} ranks (supported: 2..{MAX_RANKS})")
    lib = load(toolchain, arch=cuda_build.device_arch(device))
    err = ctypes.create_string_buffer(512)
    handle = ctypes.create_string_buffer(64)
    if lib.jaxserve_car_create(int(device.local_hardware_id), rank, world, slot_bytes, handle, err, len(err)):
        raise CustomAllReduceUnavailable(err.value.decode(errors="replace"))
    return handle.raw


def open_peers(device, handles: list[bytes]) -> None:
    """Map every rank's buffer (``handles`` in rank order, this rank's included) on ``device``."""
    if any(len(h) != 64 for h in handles):
        raise CustomAllReduceUnavailable("bad IPC handle exchange")
    if _lib is None:
        raise CustomAllReduceUnavailable("create() this rank's buffer before opening its peers'")
    lib = _lib
    err = ctypes.create_string_buffer(512)
    if lib.jaxserve_car_open(int(device.local_hardware_id), b"".join(handles), err, len(err)):
        raise CustomAllReduceUnavailable(err.value.decode(errors="replace"))


def setup(device, rank: int, world: int, exchange, toolchain: cuda_build.Toolchain, *,
          slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
    """``create`` then ``open_peers``, with ``exchange(handle: bytes) -> list[bytes]`` sharing the handles
    (``distributed_exchange`` does it through ``jax.distributed``). Every rank must call it. The engine does
    the same in two agreed rounds instead (``jaxserve.parallel.collectives``), so one rank's failure cannot
    leave the others waiting."""
    open_peers(device, exchange(create(device, rank, world, toolchain, slot_bytes=slot_bytes)))


def distributed_exchange(rank: int, world: int, *, tag: str = "jaxserve-car", timeout_ms: int = 120_000):
    """``exchange`` for ``setup`` through ``jax.distributed``'s key-value store (one process per rank)."""
    from jax._src import distributed as jd
    client = jd.global_state.client
    if client is None:
        raise CustomAllReduceUnavailable("jax.distributed is not initialized")

    def exchange(handle: bytes) -> list[bytes]:
        client.key_value_set_bytes(f"{tag}/{rank}", handle)
        return [handle if q == rank else client.blocking_key_value_get_bytes(f"{tag}/{q}", timeout_ms)
                for q in range(world)]

    return exchange


def default_blocks(nbytes: int) -> int:
    """CTAs per call: one 16-byte vector per thread up to ``MAX_BLOCKS // 2`` CTAs (64 KiB: 8)."""
    vecs = max(1, nbytes // 16)
    return int(np.clip(-(-vecs // THREADS), 1, MAX_BLOCKS // 2))


def supports(shape, dtype, *, slot_bytes: int = DEFAULT_SLOT_BYTES) -> bool:
    """Whether ``all_reduce`` takes an array of this shape/dtype (else keep XLA's all-reduce)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return dtype.name in ("bfloat16", "float16", "float32") and 0 < nbytes <= slot_bytes and nbytes % 16 == 0


def all_reduce(x, *, blocks: int | None = None):
    """The sum of ``x`` over every rank set up by ``setup``; call it per device (inside ``shard_map``)."""
    import jax
    blocks = default_blocks(x.size * x.dtype.itemsize) if blocks is None else int(blocks)
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, blocks=np.int64(blocks))


def supports_add_rms_norm(shape, dtype, *, slot_bytes: int = DEFAULT_SLOT_BYTES) -> bool:
    """Whether ``all_reduce_add_rms_norm`` takes ``x`` of this shape/dtype: ``supports`` plus rows (the last
    axis) a multiple of 16 bytes."""
    return (len(shape) >= 1 and supports(shape, dtype, slot_bytes=slot_bytes)
            and (int(shape[-1]) * np.dtype(dtype).itemsize) % 16 == 0)


def all_reduce_add_rms_norm(x, residual, weight, eps: float, *, blocks: int | None = None):
    """``(s, weight * rms_norm(s))`` with ``s = residual + all_reduce(x)``: ``x`` and ``residual`` ``[.., width]``,
    ``weight`` ``[width]``, one dtype. Per device, inside ``shard_map``, like ``all_reduce``. One CTA per row
    (token), at most ``MAX_BLOCKS // 2`` CTAs, each taking every ``blocks``-th row."""
    import jax
    rows = max(1, x.size // max(1, x.shape[-1]))
    blocks = min(rows, MAX_BLOCKS // 2) if blocks is None else int(blocks)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call(TARGET_ADD_RMS_NORM, (out, out))(x, residual.astype(x.dtype), weight.astype(x.dtype),
                                                             blocks=np.int64(blocks), eps=np.float32(eps))
