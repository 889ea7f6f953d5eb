"""Which of a decode step's thunks run inside XLA's CUDA graphs (command buffers), compiled for an H200 or H100
on any host, no GPU needed.

    python -m jaxserve.benchmarks.gpu_step_hlo --model qwen3-30b-a3b --batch 1
    python -m jaxserve.benchmarks.gpu_step_hlo --model deepseek-v2-lite --gpu h100 --long --layers 4
    python -m jaxserve.benchmarks.gpu_step_hlo --model llama-3.1-8b --moving

Needs the CUDA PJRT plugin (``pip install -e .[gpu-aot]``: jax-cuda12-plugin, no CUDA libraries); on a host
without CUDA it runs with JAX_PLATFORMS=cpu, the plugin only compiling. The step is the engine's decode-only
forward for the bucket a batch of ``--batch`` pads to (``step_memory``'s abstract weights and KV cache, the
Pallas kernels), by default its short-context variant (the one a decode under 512 tokens of context runs);
it compiles under jaxserve's XLA flags (``jaxserve/xla_flags.py``) for a deviceless GPU topology.

XLA forms command buffers on the thunk sequence after emission (its CommandBufferConversionPass), so the
optimized HLO shows none: the counts come from the thunk sequence XLA dumps after its thunk passes. One JSON
line says: ``command_buffers``, ``commands`` (thunks inside them), ``outside`` (top-level thunks outside any
command buffer: each a launch of its own on every step, by thunk kind and the HLO op it came from), and the
XLA flags the compile saw. With nothing outside, ``commands`` (what a call of the graph launches) is what a
launch-bound step's host time can grow with. ``--moving`` adds ``moving_commands``: those among them that use
an allocation whose address changes from call to call, which XLA updates on every call (``cmdbuf_updates``), by
what moves (``moving_by_allocation``: a command may count under several).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import sys
import tempfile
import time

from jaxserve.benchmarks import cmdbuf_updates

# The GPUs' target descriptions (XLA's GpuTargetConfigProto, text): what XLA would query from the device.
# The versions matter: below CUDA 12.3 XLA keeps custom calls, while loops and conditionals out of the graphs.
_DEVICE = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: {cores} fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  driver_version: "13.0.0" runtime_version: "12.9.0" compile_time_toolkit_version: "12.9.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{name}"
"""
GPUS = {
    "h200": dict(name="NVIDIA H200", cores=132, bandwidth=4_800_000_000_000, memory=151_397_597_184),
    "h100": dict(name="NVIDIA H100 80GB HBM3", cores=132, bandwidth=3_352_320_000_000, memory=85_520_809_984),
}
METADATA = re.compile(r'profile_annotation: "([^"]*)"\s*(?:thunk_id: (\d+)\s*)?}\s*thunk_kind: "(\w+)"')
HLO_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*)$")


def target_config(gpu: str) -> str:
    return _DEVICE.format(**GPUS[gpu])


def gpu_device(gpu: str):
    """A compile-only device of ``gpu`` (the CUDA plugin's topology: nothing runs on it)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=target_config(gpu)).devices[0]


def compile_step(model: str, batch: int, gpu: str, layers: int | None, long_context: bool, dump_dir: str,
                 dtype: str = "bfloat16", key: tuple | None = None):
    """The decode step's compiled executable for ``gpu`` in ``dtype``, XLA's dumps of it in ``dump_dir``; ``key``:
    another of the step's variants (``("forward", T, False)``: a step with prefill chunks of ``T`` tokens)."""
    import jax

    from jaxserve.benchmarks import step_memory
    from jaxserve.kernels.metadata import SHORT_SEQ_LEN

    device = gpu_device(gpu)
    cfg, family = step_memory.model_config(model, layers)
    variants, _, _ = step_memory.abstract_variants(cfg, family, None, [4, 8, 16, 32, 64, 128, 256], 1024, "pallas",
                                                   max_num_seqs=max(batch, 4), dtype=jax.numpy.dtype(dtype))
    variants.programs.directory = None          # trace: no stored program, none written
    on_gpu = jax.sharding.SingleDeviceSharding(device)
    put = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_gpu)  # noqa: E731
    variants._param_specs = jax.tree.map(put, variants._param_specs)
    variants._kv_specs = jax.tree.map(put, variants._kv_specs)
    variants._prev_spec = put(variants._prev_spec)
    T = variants.shapes.bucket_for(batch)
    if key is None:
        key = ("forward", T, True) if long_context or not variants.short_decode else ("forward", T, True, SHORT_SEQ_LEN)
    lowered = step_memory.lowered_for_cuda(variants, key)
    return key, lowered.compile(compiler_options={"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": "forward"})


def thunk_counts(sequence: str, metadata: str, hlo: str) -> dict:
    """Command buffers, the thunks inside them, and the top-level thunks outside them by kind and HLO op, from
    XLA's ``thunk_sequence_after_thunk_passes.txt`` and ``thunk_metadata.txt`` dumps and the optimized HLO."""
    names = {int(i or 0): name for name, i, _ in METADATA.findall(metadata)}
    ops = {}
    for line in hlo.splitlines():
        m = HLO_OP.match(line)
        if m:
            name, op, rest = m.groups()
            target = re.search(r'custom_call_target="([^"]+)"', rest) if op == "custom-call" else None
            ops[name] = f"custom-call {target.group(1)}" if target else op
    buffers, inside, nested_outside = 0, collections.Counter(), 0
    outside: collections.Counter = collections.Counter()
    for top_kind, indent, thunk_id, kind in cmdbuf_updates.thunks(sequence):
        if indent == 0:
            if kind == "kCommandBuffer":
                buffers += 1
            else:
                outside[f"{kind} {ops.get(names.get(thunk_id, ''), '?')}"] += 1
        elif top_kind == "kCommandBuffer":
            inside[kind] += 1
        else:
            nested_outside += 1             # in a while's or conditional's body outside the graphs
    return {"command_buffers": buffers, "commands": sum(inside.values()), "commands_by_kind": dict(inside),
            "outside": sum(outside.values()), "outside_by_kind": dict(outside.most_common()),
            "nested_outside": nested_outside}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a configs/models name")
    ap.add_argument("--batch", type=int, default=1, help="decoding requests (the step pads to its bucket)")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--long", action="store_true", help="the decode variant for contexts over 512 tokens")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV cache")
    ap.add_argument("--dump", default=None, help="keep XLA's dumps in this folder (default: a temporary one)")
    ap.add_argument("--moving", action="store_true",
                    help="also count the commands that use an allocation whose address changes from call to call "
                         "(the ones XLA updates on every call: cmdbuf_updates)")
    a = ap.parse_args(argv)
    import jax

    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")   # the CUDA plugin compiles for the topology, runs nothing
    from jaxserve.benchmarks import step_memory
    step_memory.use_gpu_moe_path()
    with tempfile.TemporaryDirectory() as tmp:
        dump = a.dump or tmp
        t0 = time.perf_counter()
        key, compiled = compile_step(a.model, a.batch, a.gpu, a.layers, a.long, dump, a.dtype)
        found = {p.name.split(".")[-2]: p for p in pathlib.Path(dump).glob("*jit_forward_fn*.txt")}
        # (no file "after thunk passes" when the passes changed nothing: no command buffer formed)
        sequence = found.get("thunk_sequence_after_thunk_passes", found["thunk_sequence"])
        counts = thunk_counts(sequence.read_text(),
                              found["thunk_metadata"].read_text(), compiled.as_text())
        if a.moving:
            assignment = {p.name.rsplit("-", 2)[-1]: p
                          for p in pathlib.Path(dump).glob("*forward_fn*buffer-assignment*")}
            counts.update(cmdbuf_updates.moving_commands(
                sequence.read_text(), found["thunk_metadata"].read_text(), assignment["assignment.txt"].read_text(),
                assignment["values.txt"].read_text(), skip_temp="SKIP_TEMP" in os.environ.get("XLA_FLAGS", "")))
    print(json.dumps({"model": a.model, "batch": a.batch, "variant": list(key[1:]), "gpu": GPUS[a.gpu]["name"],
                      **counts, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
