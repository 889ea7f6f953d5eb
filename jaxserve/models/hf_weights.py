"""The weight pytree built from HF-layout tensors, on the device(s): what the safetensors and GGUF loaders share.

Every such source goes through one plan (the family's ``weight_plan``, see ``checkpoint_names``): for each leaf
of the family's weight pytree, the HF tensor names it is built from and how (as is, transposed to
``[in, out]``, gate/up transposed and stacked, a fused projection split). A source only supplies
``get(hf_name) -> np.ndarray`` in HF layout. Tensors go host → device *in HF layout* (for safetensors straight
from the memory-mapped file, no host copy, and its pages unmapped once built (``get.release``): the host holds
about the tensors in flight; a few threads read and copy the next tensors while the weights before them are
built), and the layout change and the cast to the target dtype run on the device. With a
``mesh`` each HF tensor is placed with the sharding that its layout change maps onto the weight's ``NamedSharding(mesh, spec)`` (from the family's ``param_partition_specs``), so
every device converts only its own shard and no weight is ever whole on one device (unless its spec
replicates it).

Why on the device: numpy's transpose of 2-byte elements is a slow strided copy on one core, which made a
large model's load from safetensors several times slower than restoring the converted layout from orbax.

Quantized checkpoints (``quantization``, vLLM's ``--quantization``): the plan's projections whose modules the
checkpoint quantizes go through ``jaxserve.quantization.loading`` instead (int4 formats repacked on the host,
fp8 weights kept output-major), and land in the tree as ``Int4Weight`` / ``Fp8Weight`` leaves with the same
tensor-parallel split; online fp8 quantizes each float projection on the device as soon as it is built.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.quantization import loading as quant_loading

# How a weight is built from its HF tensors (checkpoint_names says what each build means).
_BUILDS = {
    "same": lambda w: w,
    "t": lambda w: w.T,
    "stack_t": lambda g, u: jnp.stack([g.T, u.T], axis=1),
    "cat_t": lambda *ws: jnp.concatenate([w.T for w in ws], axis=1),
    "fused_gate_up_t": lambda w: w.reshape(2, w.shape[0] // 2, w.shape[1]).transpose(2, 0, 1),
    # MoE: per-expert HF tensors stacked on a leading expert axis
    "experts_stack_t": lambda *gu: jnp.stack([jnp.stack([g.T, u.T], axis=1) for g, u in zip(gu[::2], gu[1::2])]),
    "experts_t": lambda *ws: jnp.stack([w.T for w in ws]),
    # a ViT's patch embedding: a conv [out, C, p, p] → the matmul over patches flattened channel-major
    "patch_t": lambda w: w.reshape(w.shape[0], -1).T,
}


def _build_fn(kind) -> Callable:
    if isinstance(kind, tuple) and kind[0] == "rows_t":
        start, stop = kind[1], kind[2]
        return lambda w: w[start:stop].T
    if isinstance(kind, tuple) and kind[0] in ("mla_uk", "mla_uv"):
        heads, nope = kind[1], kind[2]        # kv_b_proj [heads * (nope + v), R], by head: key rows, value rows

        def split(w):
            w = w.reshape(heads, -1, w.shape[1])
            return w[:, :nope] if kind[0] == "mla_uk" else w[:, nope:].transpose(0, 2, 1)
        return split
    return _BUILDS[kind]


def _hf_spec(kind, spec):
    """The sharding spec of each HF-layout input that the build ``kind`` maps onto the weight's ``spec``
    (fused checkpoint tensors go in replicated: every device slices out its own part)."""
    spec = tuple(spec)
    if kind == "same":
        return P(*spec)
    if kind == "t":
        spec = spec + (None,) * (2 - len(spec))
        return P(spec[1], spec[0])
    if kind == "stack_t":
        spec = spec + (None,) * (3 - len(spec))          # [in, 2, out] from [out, in]
        if spec[1] is not None:
            raise ValueError(f"gate/up stack axis cannot be sharded ({P(*spec)})")
        return P(spec[2], spec[0])
    if kind == "cat_t":
        spec = spec + (None,) * (2 - len(spec))          # [in, out_1 + out_2] from [out_i, in]
        if spec[1] is not None:
            raise ValueError(f"projections joined on their output axis cannot be column-split ({P(*spec)})")
        return P(None, spec[0])
    if kind in ("experts_stack_t", "experts_t") and spec[0] is None:   # experts tensor parallel: [out, in] slices
        return P(spec[-1], spec[1])
    return P()              # expert parallel: each expert's tensor goes whole to the devices that own it


def tree_get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def tree_set(tree, path, value):
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def load_weights(cfg: ModelConfig, family: Any, get: Callable[[str], np.ndarray], dtype, *,
                 mesh=None, desc: str = "Loading weights",
                 file_of: Callable[[str], str] = lambda name: "?", quant=None, threads: int = 0) -> dict:
    """Build the family's weight pytree from ``get(hf_name)`` onto the device(s): each HF tensor goes to the
    device(s) as it is, and a jitted build (layout change, cast) runs there. ``threads`` > 0: that many
    threads read and copy the next tensors (at most two each ahead of the build, so the host holds a bounded
    number of tensors) while this one builds, in a single-process engine; ``get`` must then be thread-safe.
    The weights and the first error are the same as one at a time. ``quant`` (a ``quantization.QuantConfig``): the projections it
    covers load quantized (``quantization.loading``), or are quantized once built (online fp8)."""
    shapes = family.param_shapes(cfg)
    shardings = None
    if mesh is not None:
        from jaxserve.parallel import param_shardings  # noqa: PLC0415
        # checks the heads split evenly (one clear error before any weight moves) and keeps whole kv
        # heads on each device when tp > num_kv_heads
        shardings = param_shardings(family.param_partition_specs(cfg), mesh, cfg)
    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    target_dtype = jnp.dtype(dtype)
    dtypes = family.param_dtypes(cfg, target_dtype)             # a few weights keep a dtype of their own
    builders: dict = {}
    has = getattr(get, "has", lambda name: True)
    release = getattr(get, "release", None)    # a memory-mapped source: unmap what a finished copy read

    def is_quantized(path, names) -> bool:
        return quant is not None and quant_loading.is_linear(path) and all(
            quant.quantizes(quant_loading.module_of(n)) for n in names)

    def fetch(path, names, kind):
        """One plan entry read and copied to its device(s): (True, the finished quantized weight) or (False,
        its HF tensors placed in the sharding its build reads)."""
        expected = tree_get(shapes, path)
        sharding = tree_get(shardings, path) if shardings is not None else None
        if is_quantized(path, names) and not quant.online:
            return True, quant_loading.load_linear(quant, path, names, kind, tuple(expected), sharding, get, has)
        raw = [get(n) for n in names]
        if quant is not None and quant.weights == "fp8" and not quant.online:
            raw = quant_loading.dequantize_fp8_tensors(names, raw, get, has)
        built = jax.eval_shape(_build_fn(kind), *(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in raw))
        if tuple(built.shape) != tuple(expected):
            shapes_str = ", ".join(f"{n} {tuple(r.shape)}" for n, r in zip(names, raw))
            raise ModelLoadError(f"{file_of(names[0])}: tensor {shapes_str} does not match the config "
                                 f"(expected {tuple(expected)} after layout conversion)")
        in_sharding = NamedSharding(sharding.mesh, _hf_spec(kind, sharding.spec)) if sharding is not None else None
        return False, [jax.device_put(_device_ready(r), in_sharding) for r in raw]

    def build_on_device(kind, placed, to_dtype, sharding):
        key = (kind, sharding, jnp.dtype(to_dtype))
        if key not in builders:
            fn = functools.partial(_build_cast, _build_fn(kind), jnp.dtype(to_dtype))
            builders[key] = jax.jit(fn, out_shardings=sharding) if sharding is not None else jax.jit(fn)
        return builders[key](*placed)

    plan = family.weight_plan(cfg)
    if jax.process_count() > 1:
        threads = 0     # a put onto a mesh over several processes is a collective: every process's in one order
    def release_built(value, names):
        jax.block_until_ready(value)        # a CPU backend's copy may read the mapped pages until it is built
        for name in names:
            release(name)

    built = None        # the weight before: its pages are released once the next one is dispatched (no sync)
    with contextlib.closing(_fetched_in_order(fetch, plan, threads)) as fetched:
        for (path, names, kind), (done, value) in tqdm(fetched, total=len(plan), desc=desc, unit="tensor"):
            if not done:
                sharding = tree_get(shardings, path) if shardings is not None else None
                value = build_on_device(kind, value, tree_get(dtypes, path), sharding)
                if is_quantized(path, names):       # online: the float weight, quantized where it lies
                    value = quant_loading.quantize_leaf(quant, path, value, sharding, target_dtype)
            if release is not None:
                if built is not None:
                    release_built(*built)
                built = (value, names)
            tree_set(params, path, value)
            del value
    if built is not None:
        release_built(*built)
    return params


def _fetched_in_order(fetch: Callable, plan: list, threads: int):
    """``(entry, fetch(*entry))`` for each plan entry, in plan order; with ``threads``, fetched by a pool that
    keeps at most two entries per thread ahead of the caller, each one's copies finished on its thread."""
    if threads <= 0:
        for entry in plan:
            yield entry, fetch(*entry)
        return

    def fetch_ready(entry):
        return jax.block_until_ready(fetch(*entry))

    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="weight-reader")
    entries = iter(plan)
    ahead = collections.deque((e, pool.submit(fetch_ready, e)) for e in itertools.islice(entries, 2 * threads))
    try:
        while ahead:
            entry, future = ahead.popleft()
            result = future.result()
            following = next(entries, None)
            if following is not None:
                ahead.append((following, pool.submit(fetch_ready, following)))
            yield entry, result
            del result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _build_cast(build, dtype, *ws):
    return build(*ws).astype(dtype)


def _device_ready(a: np.ndarray) -> np.ndarray:
    """C-contiguous for the host-to-device copy (memory-mapped safetensors views already are: no copy)."""
    return np.ascontiguousarray(a)
