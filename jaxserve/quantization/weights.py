"""Quantized linear weights as pytrees in the weight tree, and the matmul each one runs.

A quantized projection replaces its float ``[in, *out]`` leaf (``q``, ``gate_up [hidden, 2, inter]``, ...) with
an ``Int4Weight`` or ``Fp8Weight`` of the same logical shape; the model code calls ``matmul(x, w)`` and never
looks inside. Every array of one weight is laid out ``[in-ish, *out]`` so a tensor-parallel weight spec
applies to all of them alike: a row-parallel weight splits its first axis (K rows, K/8 packed rows, K/G
groups, K/128 blocks), a column-parallel one its last. ``tp_axis`` (static) says which one was split, so the
matmul can run the local product in ``shard_map`` (a Pallas call cannot be partitioned by XLA) and sum
row-parallel partials.

On CPU the int4 weight is dequantized in jnp (the path tests and the embedded model run); on a GPU steps of
up to ``INT4_KERNEL_MAX_TOKENS`` tokens go through the CUDA GEMV ``kernels.quant_gemv`` (an XLA FFI call, built
with the host's nvcc on first use) where it can run (nvcc, bf16), else (or with ``JAXSERVE_INT4_FFI_GEMV=0``)
through ``kernels.int4_matmul_pallas``, both dequantizing in registers; ``JAXSERVE_INT4_GEMV_MAX_TOKENS`` above 16
runs the GEMV on larger steps too, 16 rows a call; larger steps dequantize and run XLA's GEMM.
FP8 per-channel weights run W8A8 as an fp8 dot with float32 accumulation (XLA's cuBLASLt fp8 GEMM on Hopper
GPUs), the per-token activation scale and the weight's channel scale applied to the result; 128 × 128 block
weights are dequantized to the activation dtype before the dot (W8A16). On a GPU, steps of up to 16 tokens run
both kinds weight-only through the CUDA GEMV ``kernels.quant_gemv.fp8_gemv`` (``JAXSERVE_FP8_FFI_GEMV=0``: not).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve import envs
from jaxserve.kernels import int4_matmul_pallas as int4_kernel
from jaxserve.kernels import quant_gemv
from jaxserve.parallel.collectives import kernel_toolchain
from jaxserve.parallel.mesh import current_tp_mesh

logger = logging.getLogger(__name__)

# Steps up to this many tokens (decode, small mixed steps: bound by weight bytes) run the fused int4 kernel;
# larger ones are bound by compute, where dequantizing once and running XLA's bf16 GEMM does better than
# re-dequantizing every weight tile per block of x (benchmarks/kernel_bench.py measures both:
# benchmarks/results/2026-12-01-h200-quant-moe-core.md)
INT4_KERNEL_MAX_TOKENS = 16
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)
TP = "tp"
_static = dict(static=True)
_tracing = threading.local()     # per thread: steps are traced on the step compiler's threads at once


@contextlib.contextmanager
def live_tokens(count: jax.Array):
    """While a step is traced: ``count`` (an int32 scalar on the device) of its token rows are real, the rest
    the token bucket's padding. The int4 kernel's ``gemv`` launch then computes one row when one is real
    (batch-1 decode runs a bucket of 4) and leaves the padding rows zero."""
    stack = _tracing.__dict__.setdefault("live_tokens", [])
    stack.append(count)
    try:
        yield
    finally:
        stack.pop()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """W4A16 (``kernels/int4_matmul_pallas.py`` says the layout): ``packed [K/8, *out]`` int32,
    ``scales [K/G, *out]``, ``zeros [K/G, *out]`` int8; ``perm [K]`` (GPTQ act-order: the input channels in
    group order, ``x[:, perm]`` feeds the weight's rows) or None. GGUF's Q4_1 and Q4_K have ``mins [K/G,
    *out]`` instead of zero points (``w = q * scales - mins``, ``zeros`` None); the k-quants keep their
    two-level scales: ``scales`` and ``mins`` are small integers and ``super_scales`` / ``super_mins [K/S,
    *out]`` (float16, one per super-block of S inputs) their factors (``group_scales``, ``group_mins``). GGUF's 5- to 8-bit types add ``high [K *
    high_bits / 32, *out]`` int32, each value's bits above the low four (``high_bits`` of them, packed along K
    like ``packed``), and ``w = (low + 16 high - offset) * scales - mins`` (``offset`` static, ``zeros``
    None)."""
    packed: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    perm: jax.Array | None
    group_size: int = dataclasses.field(metadata=_static)
    tp_axis: int | None = dataclasses.field(default=None, metadata=_static)
    mins: jax.Array | None = None
    super_scales: jax.Array | None = None
    super_mins: jax.Array | None = None
    high: jax.Array | None = None
    offset: int = dataclasses.field(default=0, metadata=_static)
    high_bits: int = dataclasses.field(default=4, metadata=_static)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.packed.shape[0] * int4_kernel.PACK,) + tuple(self.packed.shape[1:])

    def group_scales(self) -> jax.Array:
        """Each group's scale (float32 when it has a super-block factor, else as stored)."""
        return _times_super(self.scales, self.super_scales)

    def group_mins(self) -> jax.Array | None:
        return None if self.mins is None else _times_super(self.mins, self.super_mins)

    def specs(self, spec: P) -> "Int4Weight":
        """The PartitionSpec of each array when the float weight's spec is ``spec`` (``tp_axis`` is set
        from the same spec: ``with_tp_axis``)."""
        def opt(a):
            return None if a is None else spec
        return dataclasses.replace(self, packed=spec, scales=spec, zeros=opt(self.zeros),
                                   perm=None if self.perm is None else P(), mins=opt(self.mins),
                                   super_scales=opt(self.super_scales), super_mins=opt(self.super_mins),
                                   high=opt(self.high))


def _times_super(a: jax.Array, factor: jax.Array | None) -> jax.Array:
    """Per-group values times their super-block factor (float32: exact for 6-bit integers and float16 factors)."""
    if factor is None:
        return a
    return a.astype(jnp.float32) * jnp.repeat(factor.astype(jnp.float32), a.shape[0] // factor.shape[0], axis=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """FP8 e4m3 ``weight [*out, K]``, output-major (HF's own layout: the one cuBLASLt's fp8 GEMM takes
    without a transpose, both operands K-minor); its logical shape is ``[K, *out]`` like every projection's.
    ``scale`` float32 ``[*out]`` per output channel (per-tensor scales are stored broadcast) or
    ``[K/128, *out/128]`` per 128 × 128 block (``block=True``); ``input_scale`` the static per-tensor
    activation scale, or None (dynamic per-token scales)."""
    weight: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None
    block: bool = dataclasses.field(default=False, metadata=_static)
    tp_axis: int | None = dataclasses.field(default=None, metadata=_static)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.weight.shape[-1],) + tuple(self.weight.shape[:-1])

    def specs(self, spec: P) -> "Fp8Weight":
        ndim = self.weight.ndim
        full = tuple(spec) + (None,) * (ndim - len(tuple(spec)))      # over the logical [K, *out]
        axis = _tp_axis(spec)
        if self.block:
            scale_spec = P(*full)
        else:   # [*out]: split only where the outputs are
            scale_spec = P(*([None] * (ndim - 2)), TP) if axis == ndim - 1 else P()
        return dataclasses.replace(self, weight=P(*full[1:], full[0]), scale=scale_spec,
                                   input_scale=None if self.input_scale is None else P())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Activation:
    """An activation ``[T, K]`` quantized once, per token, for every fp8 W8A8 projection that reads it (a
    layer's q, k and v; its gate_up): ``q`` e4m3 and ``scale [T, 1]`` float32, ``x ≈ q * scale``. Made by
    ``rms_norm_fp8`` inside the norm's own kernels instead of an amax and a cast before each projection."""
    q: jax.Array
    scale: jax.Array
    dtype: object = dataclasses.field(metadata=_static)     # the activation's own dtype: the products' dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


QUANTIZED_TYPES = (Int4Weight, Fp8Weight)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED_TYPES)


def bytes_by_storage(tree) -> dict[str, tuple[int, int]]:
    """The weight tree's device bytes and weight count by storage: ``int4``, ``int5`` / ``int6`` / ``int8``
    (int4 weights with a high plane: GGUF's 5- to 8-bit types) and ``fp8`` (every array of the quantized
    weights, scales included), each float dtype by name."""
    out: dict[str, tuple[int, int]] = {}
    for leaf in jax.tree.leaves(tree, is_leaf=is_quantized):
        if isinstance(leaf, Int4Weight):
            kind = "int4" if leaf.high is None else f"int{4 + leaf.high_bits}"
        elif isinstance(leaf, Fp8Weight):
            kind = "fp8"
        else:
            kind = jnp.dtype(leaf.dtype).name
        nbytes = sum(a.nbytes for a in jax.tree.leaves(leaf))
        total, count = out.get(kind, (0, 0))
        out[kind] = (total + nbytes, count + math.prod(leaf.shape))
    return out


def describe_bytes(tree) -> str:
    """``bytes_by_storage`` as one phrase: ``int4 0.06 GB (5.00 bits/weight), float32 0.12 GB``."""
    parts = []
    for kind, (nbytes, count) in sorted(bytes_by_storage(tree).items(), key=lambda kv: -kv[1][0]):
        bits = f" ({8 * nbytes / count:.2f} bits/weight)" if kind.startswith(("int", "fp8")) and count else ""
        parts.append(f"{kind} {nbytes / 1e9:.3f} GB{bits}")
    return ", ".join(parts)


def with_tp_axis(w, spec: P):
    """``w`` marked with the axis that ``spec`` splits over ``"tp"`` (None: replicated)."""
    return dataclasses.replace(w, tp_axis=_tp_axis(spec))


def _tp_axis(spec: P) -> int | None:
    return next((i for i, a in enumerate(tuple(spec)) if a == TP), None)


# ------------------------------------------------------------------------------------------ the matmul
def matmul(x: jax.Array, w) -> jax.Array:
    """``x [T, K]`` times the quantized weight ``w [K, *out]`` → ``[T, *out]`` in ``x``'s dtype; summed over
    the devices when ``w`` is row-parallel under a tp mesh."""
    mesh = current_tp_mesh()
    stack = getattr(_tracing, "live_tokens", None)
    live = stack[-1] if stack and isinstance(w, Int4Weight) else None
    if mesh is None or w.tp_axis is None:
        return _local_matmul(x, w, live)
    wspec = w.specs(_spec_on_axis(len(w.shape), w.tp_axis))
    out_ndim = len(w.shape)            # [T, *out]
    # the live count goes in as a replicated operand (a traced value is not closed over into shard_map)
    live_in = jnp.zeros((), jnp.int32) if live is None else live
    with_live = live is not None
    if w.tp_axis == 0:               # row-parallel: x split on K, partial sums reduced
        def local(xs, ws, lv):
            return jax.lax.psum(_local_matmul(xs, ws, lv if with_live else None), TP)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, TP), wspec, P()), out_specs=P(),
                             check_vma=False)(x, w, live_in)
    out_spec = P(*([None] * (out_ndim - 1)), TP)
    # check_vma=False: the Pallas kernel's loop carries no varying-manual-axes annotations (parallel/attention.py)
    return jax.shard_map(lambda xs, ws, lv: _local_matmul(xs, ws, lv if with_live else None), mesh=mesh,
                         in_specs=(P(), wspec, P()), out_specs=out_spec, check_vma=False)(x, w, live_in)


def _spec_on_axis(ndim: int, axis: int) -> P:
    return P(*[TP if i == axis else None for i in range(ndim)])


def _local_matmul(x: jax.Array, w, live: jax.Array | None = None) -> jax.Array:
    out_shape = tuple(w.shape[1:])
    n = math.prod(out_shape)
    if isinstance(w, Int4Weight):
        y = _int4_matmul(x, w, n, live)
    else:
        y = _fp8_matmul(x, w, n)
    return y.reshape(x.shape[:-1] + out_shape)


def _int4_matmul(x: jax.Array, w: Int4Weight, n: int, live: jax.Array | None) -> jax.Array:
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=1)
    k = x.shape[-1]
    packed, high, scales, zeros, mins = (None if a is None else a.reshape(a.shape[0], n)
                                         for a in (w.packed, w.high, w.group_scales(), w.zeros, w.group_mins()))
    m = x.shape[0]
    kernel = int4_step_kernel(m, k, n, w.group_size, x.dtype) if jax.default_backend() == "gpu" else None
    if kernel is None:
        x, packed, high, scales, zeros, mins = _after_input(x, packed, high, scales, zeros, mins)
        return int4_kernel.int4_matmul_reference(x, packed, scales, zeros, w.group_size, mins, high, w.offset,
                                                 w.high_bits)
    # the kernels always apply a zero point; a wide weight is its low plane's product plus its high plane's
    # (16 times the scales, the offset over 16: exact for GGUF's offsets 16, 32 and 128)
    planes = [(packed, scales, jnp.zeros(scales.shape, jnp.int8) if zeros is None else zeros)]
    if high is not None:        # the high bits widened to nibbles for the kernels (a copy per call)
        nibbles = int4_kernel.pack_int4(int4_kernel.unpack_bits(high, w.high_bits))
        planes = [(packed, scales, jnp.zeros(scales.shape, jnp.int8)),
                  (nibbles, scales.astype(jnp.float32) * 16, jnp.full(scales.shape, w.offset // 16, jnp.int8))]
    ys = [_int4_kernel(kernel, x, p, s, z, w.group_size, live) for p, s, z in planes]
    if len(ys) == 1 and mins is None:
        return ys[0]
    y = sum(a.astype(jnp.float32) for a in ys)
    if mins is not None:
        y = y - int4_kernel.group_mins_product(x, mins, w.group_size)
    return y.astype(x.dtype)


def _int4_kernel(kernel: str, x, packed, scales, zeros, group_size: int, live) -> jax.Array:
    if kernel == "ffi":       # steps above 16 tokens: calls of 16 rows, each reading the weights once
        rows = quant_gemv.MAX_ROWS
        return jnp.concatenate([quant_gemv.int4_gemv(x[i:i + rows], packed, scales, zeros, group_size=group_size,
                                                     variant=envs.JAXSERVE_INT4_GEMV_VARIANT)
                                for i in range(0, x.shape[0], rows)])
    m, k, n = x.shape[0], x.shape[1], packed.shape[1]
    live = live if live is not None and m > 1 else None
    cfg = int4_kernel.default_config(m, k, n, group_size, live_one=live is not None)
    if cfg.method != "gemv":
        live = None
    return int4_kernel.int4_matmul(x, packed, scales, zeros, group_size=group_size, config=cfg, live_rows=live)


def int4_step_kernel(m: int, k: int, n: int, group_size: int, dtype) -> str | None:
    """The kernel a GPU runs an int4 product of ``m`` tokens with: ``"ffi"`` (the CUDA GEMV), ``"pallas"``, or
    None (dequantize, then XLA's GEMM)."""
    if m > max(INT4_KERNEL_MAX_TOKENS, envs.JAXSERVE_INT4_GEMV_MAX_TOKENS):
        return None
    rows = min(m, quant_gemv.MAX_ROWS)
    if envs.JAXSERVE_INT4_FFI_GEMV and quant_gemv.supports(rows, k, n, group_size, dtype) and quant_gemv_ready():
        return "ffi"
    if m > INT4_KERNEL_MAX_TOKENS:
        return None
    return "pallas" if int4_kernel.supports(m, k, n, group_size) else None


@functools.lru_cache(maxsize=1)
def quant_gemv_ready() -> bool:
    """Whether the CUDA GEMVs are built and registered in this process (tried once; one log line when not)."""
    try:
        quant_gemv.load(kernel_toolchain())
    except quant_gemv.QuantGemvUnavailable as e:
        logger.warning("int4 decode steps run the Pallas kernel (fp8 ones XLA's dot): the CUDA GEMV is "
                       "unavailable (%s)", e)
        return False
    return True


def _after_input(x, *weights):
    """``x`` and ``weights`` through one optimization barrier: a weight dequantized to ``x``'s dtype depends on
    ``x``, so XLA cannot hoist every layer's dequantization to the start of the step and hold all those bf16
    copies at once (without the barrier an int4 forward's temporaries grew several-fold, and an 8B model's
    ran out of GPU memory). One layer's copy at a time is live."""
    return jax.lax.optimization_barrier((x, *weights))


def quantize_activation_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x_fp8, scale [T, 1] float32)`` with ``x ≈ x_fp8 * scale`` row by row (dynamic, per token)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.maximum(amax, 1e-12) / FP8_MAX
    return _to_fp8(x.astype(jnp.float32) / scale), scale


def fp8_step_uses_gemv(tokens: int) -> bool:
    """Whether fp8 weights run weight-only through the CUDA GEMV in a step of ``tokens`` tokens
    (``JAXSERVE_FP8_FFI_GEMV``, a GPU whose nvcc built it; each weight still checks its shape)."""
    return (bool(envs.JAXSERVE_FP8_FFI_GEMV) and tokens <= quant_gemv.MAX_ROWS and jax.default_backend() == "gpu"
            and quant_gemv_ready())


def reads_fp8_activations(weights, tokens: int) -> bool:
    """Whether every one of ``weights`` quantizes its input per token (fp8 W8A8, dynamic scales) in a step of
    ``tokens`` tokens: then their input can be quantized once, where it is made (``rms_norm_fp8``), unless
    ``JAXSERVE_FP8_NORM_QUANT=0``."""
    if not (envs.JAXSERVE_FP8_NORM_QUANT and weights and all(
            isinstance(w, Fp8Weight) and not w.block and w.input_scale is None for w in weights)):
        return False        # (asked before the GEMV, whose first question builds it: a bf16 model never does)
    return not (tokens <= (envs.JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS or 0) or fp8_step_uses_gemv(tokens))


# the per-token scale from max |w x| inv may sit below max |w bf16(x inv)| by the two bf16 roundings of the
# norm's output (2^-8 each): scaled up by 2^-6 the quantized row never needs the clip
_NORM_AMAX_MARGIN = 1.0 + 2.0 ** -6


def rms_norm_fp8(x: jax.Array, weight: jax.Array, eps: float) -> Fp8Activation:
    """``layers.norms.rms_norm(x, weight, eps)`` quantized per token to e4m3, in the norm's kernels: the
    row's ``max |h|`` is ``inv * max |weight * x|`` (``inv`` = 1 / rms, a positive row scalar), a reduction over
    ``x`` beside the norm's own sum of squares (one multi-output reduction on a GPU) instead of a second
    reduction over the norm's output; the cast then reads ``x`` again. HF's rounding is kept: the normed value
    is cast to ``x``'s dtype before the weight multiply, in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    # one variadic reduction (a single reduce op, so a single kernel on any backend): sum x^2 and max |w x|
    sq, wx_max = jax.lax.reduce((xf * xf, jnp.abs(weight.astype(jnp.float32) * xf)), (0.0, 0.0),
                                lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (x.ndim - 1,))
    inv = jax.lax.rsqrt(sq[..., None] / x.shape[-1] + eps)
    amax = jnp.maximum(wx_max[..., None] * inv * _NORM_AMAX_MARGIN, 1e-12)
    h = (weight * (xf * inv).astype(x.dtype)).astype(jnp.float32)
    return Fp8Activation(q=_to_fp8(h * (FP8_MAX / amax)), scale=amax / FP8_MAX, dtype=jnp.dtype(x.dtype))


def _to_fp8(x: jax.Array) -> jax.Array:
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


_CONTRACT_K = (((1,), (1,)), ((), ()))     # x [T, K] with w [N, K]


def _fp8_matmul(x, w: Fp8Weight, n: int) -> jax.Array:
    k = x.shape[-1]
    wt = w.weight.reshape(n, k)
    if isinstance(x, Fp8Activation):      # quantized where it was made (reads_fp8_activations said so)
        y = jax.lax.dot_general(x.q, wt, _CONTRACT_K, preferred_element_type=jnp.float32)
        return (y * x.scale * w.scale.reshape(1, n)).astype(x.dtype)
    if fp8_step_uses_gemv(x.shape[0]) and quant_gemv.supports_fp8(x.shape[0], k, n, x.dtype):
        scale = w.scale.reshape(w.scale.shape[0], -1) if w.block else w.scale.reshape(n)
        if not w.block or scale.shape == (-(-k // 128), -(-n // 128)):
            return quant_gemv.fp8_gemv(x, wt, scale)
    if w.block:
        x, wt, s = _after_input(x, wt, w.scale.reshape(w.scale.shape[0], -1))
        s = jnp.repeat(jnp.repeat(s, 128, axis=0)[:k], 128, axis=1)[:, :n]
        wd = (wt.astype(jnp.float32) * s.T).astype(x.dtype)
        return jax.lax.dot_general(x, wd, _CONTRACT_K, preferred_element_type=jnp.float32).astype(x.dtype)
    if w.input_scale is None and x.shape[0] <= (envs.JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS or 0):
        # weight-only: a decode step is bound by the weight bytes, which stay fp8; no activation quantization
        y = jax.lax.dot_general(x, wt.astype(x.dtype), _CONTRACT_K, preferred_element_type=jnp.float32)
        return (y * w.scale.reshape(1, n)).astype(x.dtype)
    if w.input_scale is None:
        xq, sx = quantize_activation_per_token(x)
    else:
        sx = w.input_scale.astype(jnp.float32)
        xq = _to_fp8(x.astype(jnp.float32) / sx)
    y = jax.lax.dot_general(xq, wt, _CONTRACT_K, preferred_element_type=jnp.float32)
    return (y * sx * w.scale.reshape(1, n)).astype(x.dtype)
