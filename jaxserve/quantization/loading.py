"""Loading the decoder's linear weights of a quantized checkpoint (or quantizing them at load).

``models.hf_weights.load_weights`` hands each plan entry of a projection (``q``, ``k``, ``v``, ``o``, ``gate_up``,
``down``) whose module the checkpoint quantizes to ``load_linear``; embeddings, norms and ``lm_head`` stay
float unless the checkpoint quantizes them (none of the supported formats does by default). Tensor
parallelism: every array of a weight takes the float weight's spec (``Int4Weight.specs``); a shard must hold
whole groups (int4) or whole 128 × 128 blocks (fp8), else the error names the tp size that split them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.errors import ModelLoadError

from . import gguf_formats, int4_formats, online
from .config import FP8_BLOCK, QuantConfig
from .weights import Fp8Weight, Int4Weight, with_tp_axis

# the decoder's projections (q, k and v or the three fused, and MLA's q LoRA and kv_a, or the two fused, which
# ``layers.linear`` multiplies like them)
LINEAR_WEIGHTS = ("q", "k", "v", "qkv", "o", "gate_up", "down", "q_a", "q_b", "kv_a", "fused_qkv_a")


def is_linear(path: tuple) -> bool:
    return len(path) == 3 and path[0] == "layers" and path[2] in LINEAR_WEIGHTS


def module_of(hf_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` → ``model.layers.0.self_attn.q_proj``."""
    return hf_name[:-len(".weight")] if hf_name.endswith(".weight") else hf_name


def weight_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _tp_and_axis(sharding) -> tuple[int, int | None]:
    if sharding is None:
        return 1, None
    axis = next((i for i, a in enumerate(tuple(sharding.spec)) if a == "tp"), None)
    return (sharding.mesh.shape["tp"] if axis is not None else 1), axis


def check_shards(name: str, shape: tuple, sharding, unit: int, what: str, *, input_only: bool = False) -> None:
    """A shard of ``shape`` along its tp axis must hold whole ``unit``s (groups, blocks); ``input_only``:
    the units only tile the input axis (int4 groups), so a column split is free."""
    tp, axis = _tp_and_axis(sharding)
    if axis is None or tp == 1 or (input_only and axis != 0):
        return
    size = shape[axis]
    if size % tp or (size // tp) % unit:
        raise ModelLoadError(f"{name}: tensor_parallel_size={tp} splits its {size} "
                             f"{'input' if axis == 0 else 'output'} features into shards of {size / tp:g}, "
                             f"which is not a whole number of {what} of {unit}; choose a tp size whose shards "
                             f"hold whole {what}")


def _put(a, sharding):
    return jax.device_put(np.ascontiguousarray(a), sharding) if sharding is not None else jnp.asarray(a)


def _place(weight, sharding):
    """Put each array of a quantized weight (numpy leaves) with its share of the weight's sharding."""
    if sharding is None:
        return jax.tree.map(jnp.asarray, weight)
    weight = with_tp_axis(weight, sharding.spec)
    specs = weight.specs(sharding.spec)
    mesh = sharding.mesh
    return jax.tree.map(lambda a, s: _put(a, NamedSharding(mesh, s)), weight, specs,
                        is_leaf=lambda x: isinstance(x, P))


def load_linear(q: QuantConfig, path: tuple, names: list[str], kind, expected: tuple, sharding,
                get: Callable[[str], np.ndarray], has: Callable[[str], bool]) -> Int4Weight | Fp8Weight:
    """The quantized weight at ``path`` from its checkpoint modules (``names``: their ``.weight`` names)."""
    name = weight_name(path)
    prefixes = [module_of(n) for n in names]
    if q.weights == "int4":
        parts = [_read_int4(q, p, get, has) for p in prefixes]
        whole = int4_formats.combine(parts, kind, name)
        if tuple(whole.q.shape) != tuple(expected):
            raise ModelLoadError(f"{prefixes[0]}: int4 weight of shape {tuple(whole.q.shape)} (in, out) does not "
                                 f"match the config (expected {tuple(expected)})")
        if whole.super_scales is not None:          # a row-parallel shard holds whole super-blocks
            check_shards(name, expected, sharding, expected[0] // whole.super_scales.shape[0],
                         "quantization super-blocks", input_only=True)
        check_shards(name, expected, sharding, whole.group_size, "quantization groups", input_only=True)
        tp, axis = _tp_and_axis(sharding)
        if whole.perm is not None and axis == 0 and tp > 1:
            raise ModelLoadError(f"{name}: GPTQ act-order (desc_act) weights of a row-parallel projection cannot "
                                 f"be split with tensor_parallel_size={tp} (the input permutation crosses the "
                                 f"shards); use tensor_parallel_size=1")
        return _place(int4_weight(whole), sharding)
    return _load_fp8(q, name, prefixes, kind, expected, sharding, get, has)


def int4_weight(whole: int4_formats.Int4Parts) -> Int4Weight:
    """The ``Int4Weight`` (numpy leaves) of one weight's parts: ``q`` packed (its high bits in their own plane)."""
    return Int4Weight(packed=int4_formats.pack(whole.q & 15), scales=whole.scales, zeros=whole.zeros,
                      perm=whole.perm, group_size=whole.group_size, mins=whole.mins,
                      super_scales=whole.super_scales, super_mins=whole.super_mins,
                      high=int4_formats.pack(whole.q >> 4, whole.high_bits) if whole.high_bits else None,
                      offset=whole.offset, high_bits=whole.high_bits or 4)


def _read_int4(q: QuantConfig, prefix: str, get, has) -> int4_formats.Int4Parts:
    if q.method == "gguf":          # the getter of a GGUF file also hands over a tensor's quantized rows
        return gguf_formats.read_gguf(*get.gguf_rows(f"{prefix}.weight"), name=prefix)
    if q.method == "awq":
        return int4_formats.read_awq(get, prefix, q.group_size)
    if q.method == "gptq":
        return int4_formats.read_gptq(get, prefix, q.group_size, has)
    return int4_formats.read_compressed_tensors(get, prefix, q.group_size, q.symmetric, has)


# ---------------------------------------------------------------------------------------------- fp8
def _fp8_scale(q: QuantConfig, prefix: str, get, has, n: int, k: int) -> tuple[np.ndarray, bool]:
    """(scale, block): per-channel ``[N]`` float32 (a per-tensor scale broadcast), or ``[K/128, N/128]``."""
    name = f"{prefix}.weight_scale_inv" if has(f"{prefix}.weight_scale_inv") else f"{prefix}.weight_scale"
    if not has(name):
        raise ModelLoadError(f"{prefix}: fp8 weight without weight_scale or weight_scale_inv")
    s = np.asarray(get(name)).astype(np.float32)
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    if s.size == 1:
        return np.full((n,), s.reshape(()), np.float32), False
    if s.shape in ((n,), (n, 1)):
        return s.reshape(n), False
    if s.shape == (nb, kb):
        return np.ascontiguousarray(s.T), True
    raise ModelLoadError(f"{name}: shape {s.shape} is not a per-tensor, per-channel ({n}) or 128x128 block "
                         f"([{nb}, {kb}]) scale of a [{n}, {k}] weight")


def _combine_fp8_scales(scales: list[np.ndarray], block: bool, kind, name: str) -> np.ndarray:
    if kind == "t":
        return scales[0]
    if kind == "stack_t":
        return np.stack(scales, axis=-2 if block else 0)
    if kind == "cat_t":             # per channel [N] or per block [K/128, N/128]: the outputs' axis is the last
        return np.concatenate(scales, axis=-1)
    s = scales[0]
    if isinstance(kind, tuple) and kind[0] == "rows_t":
        start, stop = kind[1], kind[2]
        if not block:
            return s[start:stop]
        if start % FP8_BLOCK or stop % FP8_BLOCK:
            raise ModelLoadError(f"{name}: rows {start}:{stop} of the fused projection cut a 128x128 scale block")
        return s[:, start // FP8_BLOCK:stop // FP8_BLOCK]
    if kind == "fused_gate_up_t":
        return s.reshape(2, -1) if not block else s.reshape(s.shape[0], 2, -1)
    raise ModelLoadError(f"{name}: build {kind!r} has no fp8 form")


def _load_fp8(q: QuantConfig, name: str, prefixes: list[str], kind, expected: tuple, sharding, get,
              has) -> Fp8Weight:
    raws = [get(f"{p}.weight") for p in prefixes]
    for p, r in zip(prefixes, raws):
        if r.dtype != ml_dtypes.float8_e4m3fn:
            raise ModelLoadError(f"{p}.weight is {r.dtype}, not float8_e4m3fn (the checkpoint's quantization_config "
                                 f"says fp8)")
    got = [_fp8_scale(q, p, get, has, r.shape[0], r.shape[1]) for p, r in zip(prefixes, raws)]
    block = got[0][1]
    if any(b != block for _, b in got):
        raise ModelLoadError(f"{name}: its modules mix block and per-channel fp8 scales")
    if block:
        if kind == "stack_t" and expected[-1] % FP8_BLOCK:
            raise ModelLoadError(f"{name}: intermediate size {expected[-1]} is not a multiple of the 128x128 blocks")
        cut = next((p for p, r in zip(prefixes[:-1], raws) if r.shape[0] % FP8_BLOCK), None)
        if kind == "cat_t" and cut is not None:     # the next module's blocks would start inside this one's last
            raise ModelLoadError(f"{name}: {cut}'s outputs are not a multiple of the 128x128 blocks, so its "
                                 f"scale blocks cannot be joined with the next module's")
        check_shards(name, expected, sharding, FP8_BLOCK, "128x128 scale blocks")
    scale = _combine_fp8_scales([s for s, _ in got], block, kind, name)
    input_scale = None
    if q.activation_scheme == "static":
        missing = [p for p in prefixes if not has(f"{p}.input_scale")]
        if missing:
            raise ModelLoadError(f"{missing[0]}: static fp8 activations need an input_scale")
        # a fused projection feeds one activation: the largest of its modules' scales covers them all (vLLM's)
        input_scale = np.float32(max(float(np.asarray(get(f"{p}.input_scale")).max()) for p in prefixes))
    weight = _build_fp8(kind, raws, sharding)
    if (weight.shape[-1],) + tuple(weight.shape[:-1]) != tuple(expected):
        raise ModelLoadError(f"{prefixes[0]}: fp8 weight {tuple(raws[0].shape)} does not match the config "
                             f"(expected {tuple(expected)} after layout conversion)")
    w = Fp8Weight(weight=weight, scale=scale, input_scale=input_scale, block=block)
    w = with_tp_axis(w, sharding.spec) if sharding is not None else w
    if sharding is None:
        return Fp8Weight(weight=weight, scale=jnp.asarray(scale),
                         input_scale=None if input_scale is None else jnp.asarray(input_scale), block=block)
    specs = w.specs(sharding.spec)
    mesh = sharding.mesh
    return Fp8Weight(weight=weight, scale=_put(scale, NamedSharding(mesh, specs.scale)),
                     input_scale=None if input_scale is None else _put(input_scale, NamedSharding(mesh, P())),
                     block=block, tp_axis=specs.tp_axis)


# The fp8 weight keeps HF's output-major layout, so a build only stacks or slices along the outputs.
_FP8_BUILDS = {
    "t": lambda w: w,
    "stack_t": lambda g, u: jnp.stack([g, u], axis=0),
    "cat_t": lambda *ws: jnp.concatenate(ws, axis=0),
    "fused_gate_up_t": lambda w: w.reshape(2, w.shape[0] // 2, w.shape[1]),
}


def _build_fp8(kind, raws: list[np.ndarray], sharding) -> jax.Array:
    """The stored ``[*out, K]`` weight from the HF ``[out, in]`` tensors, each device converting its shard."""
    if isinstance(kind, tuple) and kind[0] == "rows_t":
        start, stop = kind[1], kind[2]
        build = lambda w: w[start:stop]  # noqa: E731
    elif kind in _FP8_BUILDS:
        build = _FP8_BUILDS[kind]
    else:
        raise ModelLoadError(f"build {kind!r} has no fp8 form")
    if sharding is None:
        return jax.jit(build)(*[jnp.asarray(np.ascontiguousarray(r)) for r in raws])
    ndim = 2 if kind in ("t", "cat_t") or isinstance(kind, tuple) else 3
    full = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
    out_spec = P(*full[1:], full[0])
    if kind == "t":
        in_spec = out_spec
    elif kind == "stack_t":
        in_spec = P(*tuple(out_spec)[1:])
    else:                  # fused tensors go in replicated: every device slices out its own part
        in_spec = P()
    mesh = sharding.mesh
    placed = [jax.device_put(np.ascontiguousarray(r), NamedSharding(mesh, in_spec)) for r in raws]
    return jax.jit(build, out_shardings=NamedSharding(mesh, out_spec))(*placed)


def dequantize_fp8_tensors(names: list[str], raws: list[np.ndarray], get, has) -> list[np.ndarray]:
    """The float32 values of fp8 checkpoint tensors that no fp8 matmul reads (DeepSeek's stacked experts and
    ``kv_b_proj``, whose halves the latent attention absorbs): each ``[out, in]`` e4m3 tensor times its
    ``weight_scale_inv`` (128 x 128 blocks, the last ones partial) or per-tensor / per-channel
    ``weight_scale``. Float tensors pass through."""
    out = []
    for name, raw in zip(names, raws):
        if raw.dtype != ml_dtypes.float8_e4m3fn:
            out.append(raw)
            continue
        n, k = raw.shape
        scale, block = _fp8_scale(None, module_of(name), get, has, n, k)
        if block:
            scale = np.repeat(np.repeat(scale.T, FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k]
        else:
            scale = scale[:, None]
        out.append(raw.astype(np.float32) * scale)
    return out


# ------------------------------------------------------------------------------------------- online
def quantize_leaf(q: QuantConfig, path: tuple, w: jax.Array, sharding, scale_dtype):
    """A float projection quantized on the device: fp8 per channel, or int4 groups (random weights)."""
    name = weight_name(path)
    if q.weights == "fp8":
        template = jax.eval_shape(online.quantize_fp8_per_channel, w)
        fn, kw = online.quantize_fp8_per_channel, {}
    else:
        group = q.group_size if q.group_size != -1 else w.shape[0]
        if w.shape[0] % group:
            raise ModelLoadError(f"{name}: {w.shape[0]} input features are not a multiple of the group size {group}")
        check_shards(name, tuple(w.shape), sharding, group, "quantization groups", input_only=True)
        kw = dict(group_size=group, scale_dtype=jnp.dtype(scale_dtype))
        template = jax.eval_shape(lambda a: online.quantize_int4(a, **kw), w)
        fn = online.quantize_int4
    out_shardings = None
    if sharding is not None:
        specs = with_tp_axis(template, sharding.spec).specs(sharding.spec)
        # jit's out_shardings must match the output's static fields: the quantizer's tp_axis is None
        out_shardings = jax.tree.map(lambda s: NamedSharding(sharding.mesh, s),
                                     dataclasses.replace(specs, tp_axis=None), is_leaf=lambda x: isinstance(x, P))
    out = online.jitted(fn, out_shardings, **kw)(w)
    return with_tp_axis(out, sharding.spec) if sharding is not None else out
