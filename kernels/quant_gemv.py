"""Quantized decode GEMMs for 1..16 rows in CUDA (``quant_gemv.cu``) as XLA FFI calls: int4 W4A16 on
``int4_matmul_pallas``'s layout (``int4_gemv``) and fp8 e4m3 weight-only W8A16 on ``Fp8Weight``'s (``fp8_gemv``).

Why: a decode step reads every weight once, so an int4 projection should take a quarter of bf16's time and an
fp8 one half; the Pallas Triton int4 kernels stay far from the read ceiling (kernels/README.md). Both kernels
stream the weights with 16-byte loads, convert them in registers without int-to-float instructions where the
format allows (int4: one ``lop3`` and one bf16x2 subtraction per nibble pair, the zero point inside it,
exactly; e4m3: exact through f16 and f32), multiply on the bf16 tensor cores with the weights as the mma's A
operand (m16n8k16, float32 accumulation: up to 8 rows of x fill it, none padded in memory) and apply scales in
float32 once per group (int4) or 128-row block / channel (fp8). Neither layout needs a repack: the K labels
inside an mma are chosen so each lane's fragment is its own loaded bytes (``int4_gemv.cuh``, ``fp8_gemv.cuh``).

Launch: one block of 8 warps per 32 output columns, its warps splitting K; ``splits`` > 1 also splits K across
blocks (short-and-wide shapes would leave SMs idle), the last block of a column tile adding the float32
partials in split order (deterministic) through a per-device arrival counter. An int4 warp loads a chunk of 4
or 8 K steps (32 rows each) before their math; ``default_launch`` picks the chunk, and splits K only where a
warp would walk a long chain of steps (the partials cost more than idle SMs: benchmarks/results).

Variants of the int4 kernel (``VARIANTS``; the engine's is ``JAXSERVE_INT4_GEMV_VARIANT``, default the
register-pipelined "v1"): the same kernel with registers capped for 3 or 4 blocks an SM (kernels/README.md).

Limits: bf16 activations, 1..16 rows, N a multiple of 8; int4: K and the group size multiples of 32, scales
bf16, f16 or f32, zero points always applied (symmetric formats store 8) (``supports``); fp8: K a multiple of
64, float32 scales (``supports_fp8``). Built with the machine's ``nvcc`` on first use (``cuda_build``);
``QuantGemvUnavailable`` says why it cannot run.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
from pathlib import Path

import numpy as np

from . import cuda_build

SOURCE = Path(__file__).with_name("quant_gemv.cu")
TARGET_INT4 = "jaxserve_int4_gemv"
TARGET_FP8 = "jaxserve_fp8_gemv"
MAX_ROWS = 16
STEP_K = 32                     # K rows per warp step (as in the .cu)
FP8_STEP_K = 64                 # the fp8 kernel's, in chunks of 2 steps (128 rows: one block-scale row)
CHUNKS = (4, 8)                 # consecutive steps a warp loads at once (8: up to 8 rows, groups of >= 128)
BLOCK_COLS = 32                 # output columns per block
WARPS = 8                       # warps per block, each taking every 8th chunk of the block's K range
BLOCKS_PER_SM = 2               # resident blocks of 256 threads at <= 128 registers
WARP_STEPS = 32                 # K steps a warp walks before default_launch splits K across blocks
SLOTS = 16                      # counter regions: consecutive calls use different ones
SLOT_TILES = 4096               # column tiles per region
# int4 kernel variants (the .cu's ``variant`` attribute is the index): "v1" the register-pipelined kernel (the
# default); "occ3" / "occ4" the same with registers capped so 3 / 4 blocks fit an SM (<= 80 / 64 registers,
# chunks of 4 steps; above 8 rows they spill, so the default kernel runs those)
VARIANTS = ("v1", "occ3", "occ4")
VARIANT_BLOCKS_PER_SM = {"v1": 2, "occ3": 3, "occ4": 4}

_lib = None
_load_lock = threading.Lock()      # steps are traced on several threads at once
_slots = itertools.count()


class QuantGemvUnavailable(RuntimeError):
    """The FFI kernel cannot run here (no nvcc, no GPU, the build failed, ...); the message says why."""


def build(toolchain: cuda_build.Toolchain, *, arch: str | None = None) -> Path:
    """Compile ``quant_gemv.cu`` (once per source/compiler/architecture/headers); the shared library's path."""
    return cuda_build.build(SOURCE, toolchain, arch=arch, error=QuantGemvUnavailable)


def load(toolchain: cuda_build.Toolchain):
    """Build the library for this process's GPUs, register its FFI target and set up every local GPU's split-K
    counters (once per process); raise ``QuantGemvUnavailable`` when it cannot."""
    global _lib
    with _load_lock:
        if _lib is None:
            _lib = _load(toolchain)
    return _lib


def _load(toolchain: cuda_build.Toolchain):
    import jax
    import jax.ffi
    if jax.default_backend() != "gpu":
        raise QuantGemvUnavailable(f"needs an NVIDIA GPU (backend is {jax.default_backend()!r})")
    devices = jax.local_devices()
    path = build(toolchain, arch=cuda_build.device_arch(devices[0]))
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise QuantGemvUnavailable(f"cannot load {path}: {e}") from e
    lib.jaxserve_quant_gemv_init.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint64]
    err = ctypes.create_string_buffer(512)
    for d in devices:
        if lib.jaxserve_quant_gemv_init(int(d.local_hardware_id), err, len(err)):
            raise QuantGemvUnavailable(err.value.decode(errors="replace"))
    jax.ffi.register_ffi_target(TARGET_INT4, jax.ffi.pycapsule(lib.JaxserveInt4Gemv), platform="CUDA")
    jax.ffi.register_ffi_target(TARGET_FP8, jax.ffi.pycapsule(lib.JaxserveFp8Gemv), platform="CUDA")
    return lib


def supports(m: int, k: int, n: int, group_size: int, dtype) -> bool:
    """Whether ``int4_gemv`` takes ``x [m, k]`` of ``dtype`` and a ``[k, n]`` weight with groups of ``group_size``."""
    return (np.dtype(dtype).name == "bfloat16" and 1 <= m <= MAX_ROWS and k % STEP_K == 0 and n % 8 == 0
            and group_size % STEP_K == 0 and k % group_size == 0 and -(-n // BLOCK_COLS) <= SLOT_TILES)


def supports_fp8(m: int, k: int, n: int, dtype) -> bool:
    """Whether ``fp8_gemv`` takes ``x [m, k]`` of ``dtype`` and an e4m3 ``[n, k]`` weight."""
    return (np.dtype(dtype).name == "bfloat16" and 1 <= m <= MAX_ROWS and k % FP8_STEP_K == 0 and n % 8 == 0
            and -(-n // BLOCK_COLS) <= SLOT_TILES)


def default_fp8_splits(k: int, n: int, sms: int) -> int:
    """``fp8_gemv``'s K splits: one (the partials cost more than idle SMs, as for int4), unless the column tiles
    cover fewer than half the SMs, then the fewest splits whose blocks do (at most one 2-step chunk a warp)."""
    tiles = -(-n // BLOCK_COLS)
    return max(1, min(max_splits(k // 2, 2), -(-sms // (2 * tiles))))


def chunk_steps(m: int, group_size: int, chunk: int, variant: str = "v1") -> int:
    """The steps per warp load the kernel runs when asked for ``chunk``: 8 only up to 8 rows and for groups of
    128 rows or more (else its registers spill), 4 otherwise and in every other variant (as the .cu's
    ``launch_for``)."""
    g = group_size // STEP_K
    return 8 if chunk == 8 and m <= 8 and (g & -g) >= 4 and variant == "v1" else 4


def blocks_per_sm(variant: str, m: int) -> int:
    """Resident blocks an SM the variant's launch plans for (its registers; above 8 rows the occupancy variants
    run the default kernel)."""
    return VARIANT_BLOCKS_PER_SM[variant if m <= 8 else "v1"]


def max_splits(k: int, chunk: int = 4) -> int:
    """The most K splits a ``[k, n]`` weight takes with one chunk of ``chunk`` steps each."""
    return -(-(k // STEP_K) // chunk)


def fill(k: int, n: int, sms: int, chunk: int, splits: int, per_sm: int = BLOCKS_PER_SM) -> float:
    """How full the launch keeps the GPU: the waves of resident blocks (``per_sm`` an SM) it fills (1.0: whole
    waves), times the share of a block's warps that have a chunk of K to load."""
    blocks = -(-n // BLOCK_COLS) * splits
    slots = per_sm * sms
    busy = min(1.0, max_splits(k, chunk) / splits / WARPS)
    return blocks / (-(-blocks // slots) * slots) * busy


def default_launch(m: int, k: int, n: int, group_size: int, sms: int, variant: str = "v1") -> tuple[int, int]:
    """``(chunk, splits)``: the chunk of the launch that fills the GPU best (``fill``: the fewest K splits whose
    blocks fill a wave of ``sms`` SMs at least 90 %, the larger chunk on a tie), run with ``launch_splits``:
    splitting K across blocks costs more (float32 partials, the arrival counter, a second pass) than filling
    the waves gains, so K is split only where a warp would otherwise walk more than ``WARP_STEPS`` steps."""
    return (chunk := fullest_chunk(m, k, n, group_size, sms, variant)), launch_splits(k, chunk)


def launch_splits(k: int, chunk: int) -> int:
    """The fewest K splits that leave each of a block's warps at most ``WARP_STEPS`` steps of 32 rows."""
    return max(1, min(max_splits(k, chunk), -(-(k // STEP_K) // (WARPS * WARP_STEPS))))


def fullest_chunk(m: int, k: int, n: int, group_size: int, sms: int, variant: str = "v1") -> int:
    """The chunk (steps a warp loads at once) whose fewest wave-filling K splits fill the GPU best."""
    per_sm = blocks_per_sm(variant, m)
    best = None
    for chunk in sorted({chunk_steps(m, group_size, c, variant) for c in CHUNKS}, reverse=True):
        tiles = -(-n // BLOCK_COLS)
        options = [s for s in range(1, max_splits(k, chunk) + 1) if tiles * s >= per_sm * sms] or [1]
        good = [s for s in options if fill(k, n, sms, chunk, s, per_sm) >= 0.9]
        splits = good[0] if good else max(options, key=lambda s: (fill(k, n, sms, chunk, s, per_sm), -s))
        score = fill(k, n, sms, chunk, splits, per_sm)
        if best is None or score > best[0] + 1e-9:
            best = (score, chunk)
    return best[1]


def int4_gemv(x, packed, scales, zeros, *, group_size: int, splits: int | None = None, chunk: int | None = None,
              variant: str = "v1"):
    """``x [M, K] @ w [K, N]`` for the int4 weight ``(packed, scales, zeros)`` (``int4_matmul_pallas``'s layout),
    bf16 out; ``load`` must have run in this process. ``splits`` (K splits across blocks) and ``chunk`` (steps
    per warp load, 4 or 8): None for ``default_launch``'s; ``variant`` one of ``VARIANTS``."""
    import jax
    import jax.numpy as jnp
    from .device_info import num_sms
    if variant not in VARIANTS:
        raise ValueError(f"int4 GEMV variant {variant!r} not among {', '.join(VARIANTS)}")
    m, k = x.shape
    n = packed.shape[1]
    auto_chunk, auto_splits = default_launch(m, k, n, group_size, num_sms(), variant)
    chunk = chunk_steps(m, group_size, chunk or auto_chunk, variant)
    splits = int(splits or (auto_splits if chunk == auto_chunk else launch_splits(k, chunk)))
    splits = min(splits, k // STEP_K)     # the kernel takes at most one K step per split
    partials = jax.ShapeDtypeStruct((splits * m * n if splits > 1 else 1,), jnp.float32)
    out, _ = jax.ffi.ffi_call(TARGET_INT4, (jax.ShapeDtypeStruct((m, n), x.dtype), partials))(
        x, packed, scales, zeros, group_size=np.int64(group_size), splits=np.int64(splits), chunk=np.int64(chunk),
        slot=np.int64(next(_slots) % SLOTS), variant=np.int64(VARIANTS.index(variant)))
    return out


def fp8_gemv(x, weight, scale, *, splits: int | None = None):
    """``x [M, K] @ w`` for the e4m3 weight ``weight [N, K]`` (output-major, as ``Fp8Weight`` stores it) with float32
    ``scale`` per output channel ``[N]`` or per 128 x 128 block ``[ceil(K/128), ceil(N/128)]``, bf16 out, the
    activations unquantized (W8A16); ``load`` must have run in this process."""
    import jax
    import jax.numpy as jnp
    from .device_info import num_sms
    m, k = x.shape
    n = weight.shape[0]
    splits = int(splits or default_fp8_splits(k, n, num_sms()))
    partials = jax.ShapeDtypeStruct((splits * m * n if splits > 1 else 1,), jnp.float32)
    out, _ = jax.ffi.ffi_call(TARGET_FP8, (jax.ShapeDtypeStruct((m, n), x.dtype), partials))(
        x, weight, scale.astype(jnp.float32), splits=np.int64(splits), slot=np.int64(next(_slots) % SLOTS))
    return out
