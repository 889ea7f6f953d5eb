"""Orbax checkpoints: ``convert`` any loadable model (HF folder, GGUF, dummy) into a folder that
``load_model(..., load_format="orbax")`` restores straight into the mesh's sharding (``orbax_loader`` reads it
and describes the layout).

Why orbax: each process writes and reads only its own shards, chunked, in parallel, and the stored
arrays carry no sharding, so a checkpoint written at one tensor_parallel_size restores at any other.
No layout conversion at load time: weights are stored exactly as the step consumes them
(``[in, out]``, fused gate/up, GGUF already dequantized), in the chosen dtype.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from jaxserve.errors import ModelLoadError
from jaxserve.models.orbax_loader import FORMAT_VERSION, MARKER, PARAMS_DIR, config_to_json


# ------------------------------------------------------------------------------------------------ save
def convert(model: str | None, output_dir: str, dtype: str = "auto", tensor_parallel_size: int = 1, *,
            load_format: str = "auto") -> dict:
    """Load ``model`` (sharded over ``tensor_parallel_size`` devices, so it never sits whole on one) and
    write it as an orbax checkpoint in ``output_dir``. Returns a summary (paths, sizes, seconds)."""
    from jaxserve.models.loader import load_model, model_path
    from jaxserve.parallel import make_mesh

    _check_output_dir(output_dir)
    mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
    t0 = time.perf_counter()
    # orbax stores float weights: a GGUF's are dequantized (its default keeps them quantized)
    quantization = "none" if model_path(model).endswith(".gguf") else "auto"
    loaded = load_model(model, dtype=dtype, load_format=load_format, mesh=mesh, quantization=quantization)
    load_s = time.perf_counter() - t0
    summary = save(loaded, output_dir)
    return summary | {"load_seconds": load_s}


def save(loaded, output_dir: str) -> dict:
    """Write a ``LoadedModel`` (decoder families) as an orbax checkpoint + config + tokenizer."""
    import orbax.checkpoint as ocp

    _check_output_dir(output_dir)
    if not hasattr(loaded.family, "param_shapes"):
        raise ModelLoadError(f"{loaded.source}: only decoder models can be converted to orbax")
    if getattr(loaded, "quantization", None):
        raise ModelLoadError(f"{loaded.source}: {loaded.quantization} weights cannot be converted to orbax (it "
                             f"stores float weights); serve the checkpoint itself")
    output_dir = os.path.abspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    t0 = time.perf_counter()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(output_dir, PARAMS_DIR), loaded.params)
    checkpointer.wait_until_finished()
    checkpointer.close()
    if jax.process_index() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "model_config": config_to_json(loaded.config),
            "dtype": jnp.dtype(loaded.dtype).name,
            "source": loaded.source,
            "source_load_format": loaded.load_format,
            "max_model_len": loaded.max_model_len,
            "generation_config": loaded.generation_config,
            "chat_template": loaded.chat_template,
        }
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(output_dir)
        # the marker goes last: a folder with it is complete
        with open(os.path.join(output_dir, MARKER), "w") as f:
            json.dump(meta, f, indent=1)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(loaded.params))
    return {"output_dir": output_dir, "bytes": int(nbytes), "save_seconds": time.perf_counter() - t0}


def _check_output_dir(output_dir: str) -> None:
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ModelLoadError(f"{output_dir} already exists and is not empty; choose a new --output folder")


# -------------------------------------------------------------------------------------------------- CLI
def add_convert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``python -m jaxserve convert MODEL --output DIR [--dtype] [--tensor-parallel-size]``."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF folder, .gguf file or configs/models name (default: the embedded SmolLM2)")
    parser.add_argument("--output", "-o", required=True, help="new folder for the orbax checkpoint")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="load and write over this many devices (the checkpoint restores at any size)")
    return parser


def run_convert(args: argparse.Namespace) -> int:
    summary = convert(args.model, args.output, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                      load_format=args.load_format)
    print(f"wrote {summary['output_dir']} ({summary['bytes'] / 2**20:.1f} MiB of weights; "
          f"load {summary['load_seconds']:.1f}s, save {summary['save_seconds']:.1f}s)")
    return 0
