"""What a step's compiled forward needs in memory, from shapes alone: no weight or KV cache is allocated, so
an 8B model's programs compile on a small host.

    python -m jaxserve.benchmarks.step_memory --model llama-3.1-8b --layers 4 --quantization fp8 --buckets 4d,2048
    python -m jaxserve.benchmarks.step_memory --quantization fp8 --cuda --lowered-out /tmp/lowered   # CPU host

Each bucket (``4d``: the decode-only variant of bucket 4) is lowered as the engine's ``StepVariants`` lowers it
(the runner's ``forward_fn``, the KV cache donated) and compiled for this host's backend, and one JSON line
says its ``memory_analysis()`` (temp, arguments, outputs, aliased) and the entry computation's copies of
decoder weights (``weight_copies``): a weight converted or copied outside its matmul shows there.
XLA:CPU has no fp8 dot: it converts every fp8 weight to f32 at the start of the program, so on a CPU host an
fp8 program's temp grows by 4 bytes per weight; a GPU compiles the fp8 x fp8 dots as they are.

``--cuda`` lowers for CUDA with the Pallas attention (on any host, nothing compiled) and ``--lowered-out``
writes each variant's StableHLO without source locations: diff two trees' files to see whether a change
altered the program XLA is given.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import sys
import time
import types

import jax
import jax.numpy as jnp

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*?)\)")


def model_config(model: str, num_layers: int | None = None):
    """(ModelConfig, family) of ``configs/models/<model>.json`` (``num_layers``: that many decoder layers)."""
    from jaxserve.models import configs as model_configs, packaged, registry

    hf = model_configs.read_json(str(packaged.DUMMY_CONFIG_DIR / f"{model}.json"))
    if num_layers:
        hf["num_hidden_layers"] = num_layers
    return model_configs.model_config_from_hf(hf), registry.resolve_architecture(hf.get("architectures"))[1]


def abstract_variants(cfg, family, quantization: str | None, buckets: list[int], num_blocks: int, backend: str,
                      max_model_len: int = 4096, max_num_seqs: int = 256, dtype=jnp.bfloat16):
    """(StepVariants over abstract weights (``--load-format dummy``'s, in ``quantization``'s storage) and KV
    cache of ``dtype``, weight bytes, KV bytes): nothing is allocated."""
    from jaxserve.config import EngineConfig
    from jaxserve.models.dummy_loader import dummy_params, dummy_quantization
    from jaxserve.options import from_kwargs
    from jaxserve.runner import kv_cache
    from jaxserve.runner.step_inputs import StepShapes
    from jaxserve.runner.stats import moe_layers
    from jaxserve.runner.step_variants import StepVariants

    quant = dummy_quantization(quantization)
    params = jax.eval_shape(lambda: dummy_params(cfg, family, dtype, 0, None, quant))
    max_num_seqs = min(max_num_seqs, max(buckets))
    config = from_kwargs(EngineConfig, {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                                        "max_num_batched_tokens": max(buckets), "token_buckets": buckets},
                         "LLM").resolved("gpu")
    caches = [tuple(jax.ShapeDtypeStruct(s, dtype) for s in kv_cache.layer_shapes(cfg, num_blocks, 16, dtype))
              for _ in range(cfg.num_layers)]
    loaded = types.SimpleNamespace(config=cfg, family=family, params=params, dtype=dtype, tokenizer=None)
    shapes = StepShapes(buckets, max_num_seqs, uniform_decode=backend != "reference")
    variants = StepVariants(loaded, config, shapes, backend=backend, kv_caches=caches, max_model_len=max_model_len,
                            max_blocks_per_seq=-(-max_model_len // 16), penalty_width=max_model_len,
                            moe_layers=moe_layers(loaded))     # an MoE step returns its expert load, as the engine's
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return variants, nbytes(params), nbytes(caches)


def weight_copies(compiled_text: str) -> list[str]:
    """The instructions of a compiled program's entry computation that read a decoder layer's weight and
    write at least as many elements (a convert, copy or concatenation of it; a step's matmul writes fewer
    while its tokens are fewer than the weight's rows), as ``"f32[4096,14336] <- params__layers___0___down..."``."""
    entry = compiled_text[compiled_text.index("\nENTRY"):]
    sizes, out = {}, []
    for line in entry.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, dtype, dims, op, operands = m.groups()
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        if op == "parameter":
            if name.startswith("params__layers") and n >= 2**20:      # a matrix, not a norm's vector
                sizes[name] = n
            continue
        if op in ("bitcast", "get-tuple-element", "tuple"):
            continue
        read = [o for o in re.findall(r"%([\w.\-]+)", operands) if o in sizes]
        if read and n >= min(sizes[o] for o in read):
            out.append(f"{dtype}[{dims}] <- {', '.join(read)}")
    return out


def use_gpu_moe_path() -> None:
    """The MoE layers' GPU path (the fused rows kernels) for a step compiled for CUDA on this host, where
    ``JAXSERVE_MOE_GROUPED_GEMM=auto`` would choose by the host's backend (a set value stays)."""
    os.environ.setdefault("JAXSERVE_MOE_GROUPED_GEMM", "rows_fused")


@contextlib.contextmanager
def tracing_for_cuda(device_kind: str = "NVIDIA H200", num_cores: int = 132):
    """Trace the step's GPU branches (Pallas kernels, GEMVs) on any host: jaxserve's ``jax.default_backend()``
    reads "gpu", the kernels' GPU check passes, and an abstract mesh names the GPU the Pallas kernels build for."""
    from jaxserve.kernels import ops

    saved_check, saved_backend = ops._check_gpu, jax.default_backend
    ops._check_gpu = lambda interpret: None
    jax.default_backend = lambda: "gpu"
    # (an Auto axis: under an Explicit one the MoE's ragged_dot_general asks for its output's sharding)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=jax.sharding.AbstractDevice(
                                         device_kind=device_kind, num_cores=num_cores, platform="gpu"))
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        ops._check_gpu, jax.default_backend = saved_check, saved_backend


def lowered_for_cuda(variants, key):
    """``key``'s forward lowered for CUDA (the Pallas kernels built on any host; nothing compiled)."""
    jitted = variants.forward

    class ForCuda:
        def lower(self, *args, **static):
            return jitted.trace(*args, **static).lower(lowering_platforms=("cuda",))

    variants.forward = ForCuda()
    try:
        with tracing_for_cuda():
            return variants.lower(key)
    finally:
        variants.forward = jitted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a configs/models name")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--quantization", default=None, help="fp8, awq, ... (default: bf16 weights)")
    ap.add_argument("--buckets", default="4d,2048", help="token buckets; a trailing d: the decode-only variant")
    ap.add_argument("--blocks", type=int, default=1024, help="KV cache blocks of 16 tokens")
    ap.add_argument("--backend", default="auto", help="attention backend (auto: the engine's choice here)")
    ap.add_argument("--cuda", action="store_true", help="lower for CUDA with Pallas attention, compile nothing")
    ap.add_argument("--lowered-out", default=None, help="write each variant's StableHLO into this folder")
    a = ap.parse_args(argv)
    from jaxserve.kernels import ops
    keys = [(int(k.rstrip("d")), k.endswith("d")) for k in a.buckets.split(",")]
    backend = "pallas" if a.cuda else a.backend if a.backend != "auto" else ops.default_backend()
    if a.cuda:
        use_gpu_moe_path()
    cfg, family = model_config(a.model, a.layers)
    variants, wbytes, kvbytes = abstract_variants(cfg, family, a.quantization, sorted({t for t, _ in keys}),
                                                  a.blocks, backend)
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731
    print(json.dumps({"model": a.model, "layers": variants.cfg.num_layers, "quantization": a.quantization or "none",
                      "backend": backend, "platform": "cuda (lowered only)" if a.cuda else jax.default_backend(),
                      "weights_GiB": gib(wbytes), "kv_GiB": gib(kvbytes)}), flush=True)
    out = pathlib.Path(a.lowered_out) if a.lowered_out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for T, decode_only in keys:
        key = ("forward", T, decode_only)
        t0 = time.perf_counter()
        lowered = lowered_for_cuda(variants, key) if a.cuda else variants.lower(key)
        row = {"bucket": T, "decode_only": decode_only}
        if out:
            text = re.sub(r"loc\([^)]*\)", "", lowered.as_text(debug_info=False))
            name = f"{a.quantization or 'bf16'}-{variants.cfg.num_layers}l-{T}{'d' if decode_only else ''}.mlir"
            (out / name).write_text(text)
            row["lowered"] = str(out / name)
        if not a.cuda:
            compiled = lowered.compile()
            m, text = compiled.memory_analysis(), compiled.as_text()
            copies = weight_copies(text)
            row.update(temp_GiB=gib(m.temp_size_in_bytes), argument_GiB=gib(m.argument_size_in_bytes),
                       output_GiB=gib(m.output_size_in_bytes), alias_GiB=gib(m.alias_size_in_bytes),
                       weight_copies=len(copies), first_copies=copies[:3])
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
