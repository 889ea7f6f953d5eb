"""Decode-step projections as one CUDA launch each, with the op after them fused (``decode_gemv.cu``).

Why: a batch-1 Llama-3.1-8B decode token runs ~13 kernels per layer (H200, ``step_diag.py --profile``): four
weight GEMMs, and around them small XLA fusions that each cost a launch and a few microseconds: RoPE and the
q/k/v packing (2.5 us), the residual adds that also finish the GEMMs' split-K reductions (1.7 us, twice), the
silu x up product (1.6 us). ~0.65 ms of a TP=2 rank's 2.6 ms token is such small kernels, and they do not
shrink with tensor parallelism. This kernel streams the weight itself (split-K over every SM, float32
accumulation), finishes the split-K reduction in the last CTA of each column tile, and applies the next op
there before writing bf16:

- ``gemv(h, [wq, wk, wv], rope=(cos, sin), rope_mask=0b011, head_dim=d)``: q, k and v in one launch, packed
  ``[T, nq + nk + nv]``, RoPE applied to q and k;
- ``gemv(a, [wo], residual=x)``: ``x + a @ wo`` (o and down projections);
- ``gemv(h, [w_gate_up], silu=True)`` with ``w_gate_up [K, 2, I]``: ``silu(h @ wg) * (h @ wu)``.

Each rounds as the unfused ops do (the product to bf16 first, then the op's own bf16 steps: ``reference`` is the
exact semantics); the sums run in another order than XLA's GEMMs, so results differ from them by float32
rounding, like any other GEMM choice. Steps of at most 8 tokens (``MAX_TOKENS``), bf16, no tensor parallelism
(yet). Split-K keeps a counter per column tile on the device (allocated once per device by ``enable``); calls
on one stream run in order, as XLA's do. ``JAXSERVE_DECODE_GEMV=1`` turns it on in the engine
(``jaxserve.models.llama``), ``=mlp`` for the gate/up projection only.

Measured (H200, 2026-12-01, ``benchmarks/results/2026-12-01-h200-s15-decode-gemv.md``): **off by default,
because it is slower.** The big MLP projection streams at 3.95 TB/s (``benchmarks/decode_gemv_bench.cu``), but
the split-K projections (qkv, o, down) lose 6-8 us each to the epilogue chain; a layer's four launches take 133 us
against XLA's ~120 us of GEMMs, and Llama-3.1-8B batch 1 decodes at 210.8 tok/s (``mlp``: 234.7) against XLA's
239.7. What would change that is in the results file (a stream-K grid; the all-reduce in the epilogue at TP>1).

No CPU path: tests check ``reference`` against the model's unfused ops and drive the model's fused wiring with
``reference`` standing in for the kernel; ``benchmarks/decode_gemv_probe.py`` checks and times the kernel on a GPU.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from . import cuda_build

SOURCE = Path(__file__).with_name("decode_gemv.cu")
TARGET = "jaxserve_decode_gemv"
PLAIN, RESIDUAL, SILU_MUL = 0, 1, 2
MAX_TOKENS = 8
TILE = 128                 # output columns per CTA, as in the .cu
ENV = "JAXSERVE_DECODE_GEMV"

_lib = None
_enabled = False
_ctas_per_sm = 2.0
_num_sms = 132


class DecodeGemvUnavailable(RuntimeError):
    """The decode GEMV cannot run here (no nvcc, no GPU, ...); the message says why."""


def load(arch: str | None = None):
    """The built library, its FFI target registered with XLA for CUDA (once per process)."""
    global _lib
    if _lib is None:
        import jax
        import jax.ffi
        if jax.default_backend() != "gpu":
            raise DecodeGemvUnavailable(f"needs an NVIDIA GPU (backend is {jax.default_backend()!r})")
        lib = ctypes.CDLL(str(cuda_build.build(SOURCE, arch=arch, error=DecodeGemvUnavailable)))
        lib.jaxserve_gemv_init.argtypes = [ctypes.c_int]
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveDecodeGemv), platform="CUDA")
        _lib = lib
    return _lib


def enable(devices=None, *, ctas_per_sm: float | None = None) -> str | None:
    """Build the kernel and set up every local GPU (or ``devices``); ``None`` when on, else why not."""
    global _enabled, _ctas_per_sm, _num_sms
    _enabled = False
    try:
        import jax
        devices = list(devices if devices is not None else jax.local_devices())
        lib = load(arch=cuda_build.device_arch(devices[0]) if devices else None)
        for d in devices:
            rc = lib.jaxserve_gemv_init(int(d.local_hardware_id))
            if rc:
                return f"setting up device {d}: CUDA error {rc}"
        _num_sms = int(getattr(devices[0], "core_count", 0) or _num_sms) if devices else _num_sms
    except DecodeGemvUnavailable as e:
        return str(e)
    if ctas_per_sm is not None:
        _ctas_per_sm = float(ctas_per_sm)
    _enabled = True
    return None


def enabled() -> bool:
    return _enabled


def requested() -> bool:
    """Whether the environment asks for it (``JAXSERVE_DECODE_GEMV=1``, ``all`` or ``mlp``)."""
    return os.environ.get(ENV, "0") not in ("", "0")


def mlp_only() -> bool:
    """``JAXSERVE_DECODE_GEMV=mlp``: only the gate/up projection with silu x up goes through the kernel."""
    return os.environ.get(ENV, "0") == "mlp"


def applies(tokens: int, x, *weights) -> bool:
    """Whether the model should call ``gemv`` for a step of ``tokens`` tokens on ``x [T, K]`` and these
    operands (K a multiple of 16, every array bf16)."""
    return (_enabled and 1 <= tokens <= MAX_TOKENS and x.shape[-1] % 16 == 0
            and all(a.dtype.name == "bfloat16" for a in (x, *weights)))


def fits(o_in: int, down_in: int, head_dim: int) -> bool:
    """Whether a model's o and down projections (their K) and RoPE's head_dim suit the kernel: K a multiple
    of 16, head_dim even and dividing the 128-column tile."""
    return o_in % 16 == 0 and down_in % 16 == 0 and head_dim % 2 == 0 and TILE % head_dim == 0


def padded_tokens(t: int) -> int:
    return 1 if t <= 1 else 2 if t <= 2 else 4 if t <= 4 else 8


def num_tiles(widths: list[int], silu: bool) -> int:
    per = TILE // 2 if silu else TILE
    return sum(-(-n // per) for n in widths)


def default_splits(k: int, tiles: int, *, num_sms: int | None = None, ctas_per_sm: float | None = None) -> int:
    """K splits: at most ``ctas_per_sm`` CTAs per SM in all, at most one split per 128 rows (one 16-row block
    per warp); the token count does not change it."""
    target = (num_sms or _num_sms) * (ctas_per_sm or _ctas_per_sm)
    splits = max(1, int(target // max(1, tiles)))      # one wave at most: a partial second wave costs a whole one
    return int(min(splits, max(1, k // 128)))


def _widths(weights, silu: bool) -> list[int]:
    if silu:
        (w,) = weights
        return [int(w.shape[2])]
    return [int(np.prod(w.shape[1:])) for w in weights]


def gemv(x, weights, *, residual=None, silu: bool = False, rope=None, rope_mask: int = 0, head_dim: int = 0,
         splits: int | None = None):
    """``x [T, K]`` times each weight ``[K, n]`` (``silu``: one ``[K, 2, I]``), packed ``[T, sum n]``, with the
    epilogue given (see the module docstring). ``rope = (cos, sin)``, each ``[T, head_dim]`` (or
    ``[T, 1, head_dim]``), applied to the weights whose bit is set in ``rope_mask``."""
    import jax
    import jax.numpy as jnp
    t, k = x.shape
    weights = list(weights)
    widths = _widths(weights, silu)
    tiles = num_tiles(widths, silu)
    splits = default_splits(k, tiles) if splits is None else int(splits)
    epilogue = SILU_MUL if silu else RESIDUAL if residual is not None else PLAIN
    dummy = jnp.zeros((1,), jnp.bfloat16)
    ws = [w.reshape(k, -1) if not silu else w for w in weights] + [dummy] * (3 - len(weights))
    cos, sin = (dummy, dummy) if rope is None else (rope[0].reshape(t, head_dim), rope[1].reshape(t, head_dim))
    ws_floats = splits * padded_tokens(t) * tiles * TILE if splits > 1 else 1
    out, _ = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((t, sum(widths)), jnp.bfloat16),
                                       jax.ShapeDtypeStruct((ws_floats,), jnp.float32)))(
        x, *ws, dummy if residual is None else residual, cos, sin,
        nseg=np.int64(len(weights)), epilogue=np.int64(epilogue), rope_mask=np.int64(rope_mask if rope else 0),
        splits=np.int64(splits), head_dim=np.int64(head_dim))
    return out


def reference(x, weights, *, residual=None, silu: bool = False, rope=None, rope_mask: int = 0, head_dim: int = 0,
              splits: int | None = None):
    """What ``gemv`` computes, in XLA ops (float32 products rounded to bf16, then each epilogue step rounded
    to bf16 as the kernel does): the kernel's test oracle, and its stand-in on CPU."""
    import jax
    import jax.numpy as jnp
    del splits
    t = x.shape[0]
    bf = jnp.bfloat16

    def mm(w):
        return jnp.dot(x, w.reshape(w.shape[0], -1), preferred_element_type=jnp.float32).astype(bf)

    if silu:
        (w,) = weights
        g, u = mm(w[:, 0]).astype(jnp.float32), mm(w[:, 1]).astype(jnp.float32)
        act = (g * jax.nn.sigmoid(g).astype(bf).astype(jnp.float32)).astype(bf).astype(jnp.float32)
        return (act * u).astype(bf)
    outs = []
    for i, w in enumerate(weights):
        y = mm(w)
        if rope is not None and (rope_mask >> i) & 1:
            cos = rope[0].reshape(t, 1, head_dim).astype(jnp.float32)
            sin = rope[1].reshape(t, 1, head_dim).astype(jnp.float32)
            yh = y.reshape(t, -1, head_dim).astype(jnp.float32)
            half = head_dim // 2
            rot = jnp.concatenate([-yh[..., half:], yh[..., :half]], axis=-1)
            y = ((yh * cos).astype(bf).astype(jnp.float32) + (rot * sin).astype(bf).astype(jnp.float32)).astype(bf)
            y = y.reshape(t, -1)
        outs.append(y)
    y = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    if residual is not None:
        y = (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(bf)
    return y
